use super::*;
use crate::output::formats::decode_file;
use crate::output::formats::sample_file::META_IDENTITY;
use crate::output::ledger::record::content_checksum;
use crate::output::ledger::record::file_checksum;
use crate::sample::SampleKey;
use hscapture_kernels::DType;
use safetensors::{Dtype, SafeTensors};

fn identity(convention: &str) -> Identity {
    Identity {
        format: "hscapture".into(),
        model: "m".into(),
        layer_ids: vec![1, 2, 3],
        convention: convention.into(),
        dtype: "bfloat16".into(),
        hidden_size: 4,
        num_hidden_layers: 4,
        layer_output: "sum".into(),
    }
}

fn write(path: &std::path::Path, s: &Sample, convention: &str, compress: Option<i32>) -> u64 {
    let parts = Safetensors { compress }.encode(s, &identity(convention)).unwrap();
    let bytes = parts.concat();
    std::fs::write(path, &bytes).unwrap();
    bytes.len() as u64
}

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
        loss_mask: None,
        scales: None,
    };
    let p = d.path().join("hs_3.safetensors");
    let n = write(&p, &s, "after", None);
    assert_eq!(n, std::fs::metadata(&p).unwrap().len());
    let back = crate::output::formats::read_sample_file(&p).unwrap();
    assert_eq!(back.token_ids, vec![5, 6]);
    assert_eq!(back.shape, [2, 3, 4]);
    assert_eq!(back.dtype, DType::BF16);
    assert_eq!(back.data, s.data);
    assert_eq!(content_checksum(&back.data), content_checksum(&s.data));
    assert_eq!(back.checksum, file_checksum(&std::fs::read(&p).unwrap()), "the checksum is the whole file's");
    assert_eq!(back.metadata.get("convention").map(String::as_str), Some("after"));
    let id: Identity = serde_json::from_str(&back.metadata[META_IDENTITY]).unwrap();
    assert_eq!(id, identity("after"), "each file carries its capture's identity");
    // A truncated file is reported as such.
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 3]).unwrap();
    assert!(crate::output::formats::read_sample_file(&p).unwrap_err().message.contains("truncated"));
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
        loss_mask: None,
        scales: None,
    };
    let (plain, packed) = (d.path().join("a.safetensors"), d.path().join("b.safetensors"));
    let n_plain = write(&plain, &s, "before", None);
    let n_packed = write(&packed, &s, "before", Some(3));
    assert!(n_packed < n_plain, "{n_packed} >= {n_plain}");
    let (a, b) =
        (decode_file(&plain, &std::fs::read(&plain).unwrap()).unwrap(), decode_file(&packed, &std::fs::read(&packed).unwrap()).unwrap());
    assert_eq!((a.data, a.shape, a.dtype, a.token_ids), (b.data, b.shape, b.dtype, b.token_ids));
    assert_eq!(b.metadata.get("convention").map(String::as_str), Some("before"));
    // Any safetensors reader opens it: the states are one U8 tensor beside `token_ids`.
    let bytes = std::fs::read(&packed).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor(COMPRESSED).unwrap().dtype(), Dtype::U8);
}

/// A file's bytes with its header's `hscapture.shape` replaced, as a damaged file would carry it.
fn with_shape(file: &[u8], shape: &str) -> Vec<u8> {
    let n = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let mut head: serde_json::Value = serde_json::from_slice(&file[8..8 + n]).unwrap();
    head["__metadata__"]["hscapture.shape"] = serde_json::Value::String(shape.into());
    let mut h = serde_json::to_vec(&head).unwrap();
    h.resize(h.len().next_multiple_of(8), b' ');
    [(h.len() as u64).to_le_bytes().to_vec(), h, file[8 + n..].to_vec()].concat()
}

#[test]
fn a_compressed_shape_that_overflows_is_an_error_not_an_allocation() {
    let s = Sample {
        key: SampleKey::Index(0),
        req_id: "r".into(),
        token_ids: vec![1],
        data: vec![0; 8],
        rows: 1,
        slots: 1,
        width: 4,
        dtype: DType::BF16,
        loss_mask: None,
        scales: None,
    };
    let file = Safetensors { compress: Some(1) }.encode(&s, &identity("after")).unwrap().concat();
    assert!(Safetensors { compress: None }.decode(&file, "t").is_ok());
    let e = Safetensors { compress: None }.decode(&with_shape(&file, &format!("1,{},3", usize::MAX / 2)), "t").unwrap_err();
    assert!(e.message.contains("overflow"), "{e}");
    let e = Safetensors { compress: None }.decode(&with_shape(&file, "1,1000,1000"), "t").unwrap_err();
    assert!(e.message.contains("the file is damaged"), "{e}");
}

#[test]
fn every_format_s_descriptor_says_what_its_files_do() {
    use crate::output::formats::{all, canonical, Descriptor};
    for f in all() {
        let d = Descriptor::of(f.as_ref());
        let file = f.file(&SampleKey::Index(42));
        assert_eq!(file, d.file_pattern.replace("{i}", "42"), "{}", d.name);
        let name = file.rsplit('/').next().unwrap();
        assert_eq!(f.index_of(name), Some(42), "{}", d.name);
        assert!(file.starts_with(d.folder), "{}", d.name);
        assert_eq!(canonical(d.name).unwrap(), d.name);
        for a in d.aliases {
            assert_eq!(canonical(a).unwrap(), d.name);
        }
    }
    assert_eq!(canonical("file").unwrap(), "hscapture");
    assert!(canonical("parquet").unwrap_err().message.contains("hscapture, fp8, legacy"));
    let fp8 = Descriptor::of(crate::output::formats::by_name("fp8", None).unwrap().as_ref());
    assert_eq!((fp8.stored_dtype, fp8.value_bytes, fp8.per_request_files), (Some("float8_e4m3fn"), Some(1), true));
    let legacy = Descriptor::of(crate::output::formats::by_name("legacy", None).unwrap().as_ref());
    assert_eq!((legacy.stored_dtype, legacy.folder, legacy.per_request_files), (None, "", false));
}
