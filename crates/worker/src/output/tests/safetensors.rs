use super::*;
use crate::attribution::plan::SampleKey;

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

#[test]
fn compressed_files_read_back_exactly_and_are_still_safetensors() {
    let d = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..40 * 3 * 16).flat_map(|i| half::bf16::from_f32((i as f32 * 0.1).sin()).to_le_bytes()).collect();
    let s = Sample {
        key: SampleKey::Index(0),
        req_id: "r".into(),
        token_ids: (0..40).collect(),
        data,
        rows: 40,
        slots: 3,
        width: 16,
        dtype: DType::BF16,
    };
    let (plain, packed) = (d.path().join("a.safetensors"), d.path().join("b.safetensors"));
    let meta = HashMap::from([("convention".to_string(), "before".to_string())]);
    let n_plain = write_sample_file(&plain, &s, &meta, false).unwrap();
    let n_packed = write_sample_file_with(&packed, &s, &meta, false, Some(3)).unwrap();
    assert!(n_packed < n_plain, "{n_packed} >= {n_plain}");
    let (a, b) = (read_sample_file(&plain).unwrap(), read_sample_file(&packed).unwrap());
    assert_eq!((a.data, a.shape, a.dtype, a.token_ids, a.checksum), (b.data, b.shape, b.dtype, b.token_ids, b.checksum));
    assert_eq!(b.metadata.get("convention").map(String::as_str), Some("before"));
    // Any safetensors reader opens it: the states are one U8 tensor beside `token_ids`.
    let bytes = std::fs::read(&packed).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor(COMPRESSED).unwrap().dtype(), Dtype::U8);
}
