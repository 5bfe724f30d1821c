use super::*;
use crate::plan::SampleKey;

#[test]
fn round_trip() {
    let d = tempfile::tempdir().unwrap();
    let s = Sample {
        key: SampleKey::Index(3),
        req_id: "r".into(),
        token_ids: vec![5, 6],
        data: (0..2 * 3 * 4 * 2).map(|x| x as u8).collect(),
        rows: 2,
        slots: 3,
        width: 4,
        dtype: DType::BF16,
    };
    let p = d.path().join("hs_3.safetensors");
    let meta = HashMap::from([("convention".to_string(), "after".to_string())]);
    let n = write_sample_file(&p, &s, &meta, false).unwrap();
    assert_eq!(n, std::fs::metadata(&p).unwrap().len());
    let back = read_sample_file(&p).unwrap();
    assert_eq!(back.token_ids, vec![5, 6]);
    assert_eq!(back.shape, vec![2, 3, 4]);
    assert_eq!(back.dtype, DType::BF16);
    assert_eq!(back.data, s.data);
    assert_eq!(back.checksum, content_checksum(&s.data));
    assert_eq!(back.metadata.get("convention").map(String::as_str), Some("after"));
    // A truncated file is reported as such.
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 3]).unwrap();
    assert!(read_sample_file(&p).unwrap_err().message.contains("truncated"));
}
