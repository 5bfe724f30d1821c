use super::*;
use crate::output::formats::{by_name, read_sample_file};
use half::bf16;
use safetensors::{Dtype, SafeTensors};

fn identity() -> Identity {
    Identity {
        format: "fp8".into(),
        model: "m".into(),
        layer_ids: vec![1, 2],
        convention: "after".into(),
        dtype: STORED.into(),
        hidden_size: 8,
        num_hidden_layers: 4,
        layer_output: "sum".into(),
    }
}

/// `rows` tokens of 2 layers × 8 dims in bf16; token 1 is all zeros, the others spread over many magnitudes.
fn sample(rows: usize) -> Sample {
    let mut vals = Vec::new();
    for t in 0..rows {
        for i in 0..16 {
            let v = if t == 1 { 0.0 } else { ((i as f32) - 7.3) * 10f32.powi((t as i32 % 5) - 2) * if i % 3 == 0 { -1.0 } else { 1.0 } };
            vals.push(bf16::from_f32(v));
        }
    }
    Sample {
        key: SampleKey::Index(0),
        req_id: "r".into(),
        token_ids: (0..rows as i64).collect(),
        data: vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        rows,
        slots: 2,
        width: 8,
        dtype: DType::BF16,
        loss_mask: None,
        scales: None,
    }
}

fn file(s: &Sample) -> Vec<u8> {
    Fp8.encode(s, &identity()).unwrap().concat()
}

#[test]
fn the_file_has_speculators_fp8_tensors_each_aligned() {
    let s = sample(5);
    let bytes = file(&s);
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let hs = st.tensor("hidden_states").unwrap();
    assert_eq!((hs.dtype(), hs.shape()), (Dtype::F8_E4M3, &[5usize, 2, 8][..]));
    let sc = st.tensor(SCALES).unwrap();
    assert_eq!((sc.dtype(), sc.shape()), (Dtype::F32, &[5usize, 1, 1][..]));
    let ti = st.tensor("token_ids").unwrap();
    assert_eq!((ti.dtype(), ti.shape()), (Dtype::I64, &[5usize][..]));
    let base = bytes.as_ptr() as usize + 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!((ti.data().as_ptr() as usize - base) % 8, 0);
    assert_eq!((sc.data().as_ptr() as usize - base) % 4, 0);
    // The codes and scales are the kernel's quantization of the sample.
    let (mut codes, mut scales) = (vec![0u8; 80], vec![0f32; 5]);
    fp8::quantize(&s.data, DType::BF16, 5, 16, &mut codes, &mut scales);
    assert_eq!(hs.data(), &codes[..]);
    let stored: Vec<f32> = sc.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(stored, scales);
    assert_eq!(stored[1], fp8::MIN_SCALE, "a token of zeros gets the smallest scale");
}

#[test]
fn a_file_reads_back_dequantized_to_bf16_within_fp8_precision() {
    let d = tempfile::tempdir().unwrap();
    let s = sample(7);
    let p = d.path().join("hs_0.safetensors");
    std::fs::write(&p, file(&s)).unwrap();
    let back = read_sample_file(&p).unwrap();
    assert_eq!((back.shape, back.dtype, back.stored.as_str()), ([7, 2, 8], DType::BF16, STORED));
    assert_eq!(back.token_ids, s.token_ids);
    for t in 0..7 {
        let orig: Vec<f32> = (0..16).map(|i| DType::BF16.load(&s.data, t * 16 + i)).collect();
        let amax = orig.iter().fold(0f32, |a, v| a.max(v.abs()));
        for (i, o) in orig.iter().enumerate() {
            let got = DType::BF16.load(&back.data, t * 16 + i);
            // e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value; denormals below amax/448·2^-6.
            let tol = o.abs() / 16.0 + amax / 448.0 * 2f32.powi(-9) + o.abs() / 128.0;
            assert!((got - o).abs() <= tol, "token {t} value {i}: {o} came back as {got}");
        }
    }
}

#[test]
fn damaged_or_missing_scales_are_refused() {
    let s = sample(3);
    let bytes = file(&s);
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let at = st.tensor(SCALES).unwrap().data().as_ptr() as usize - bytes.as_ptr() as usize;
    for bad in [0f32, -1.0, f32::NAN, f32::INFINITY] {
        let mut b = bytes.clone();
        b[at + 4..at + 8].copy_from_slice(&bad.to_le_bytes());
        let e = Fp8.decode(&b, "f").unwrap_err();
        assert!(e.message.contains("token 1's scale"), "{}", e.message);
    }
    // The same codes without their scales cannot be read as states.
    let q = quantize(&s).unwrap();
    let head = header(
        &[
            Tensor { name: "token_ids", dtype: "I64", shape: vec![3], bytes: 24 },
            Tensor { name: "hidden_states", dtype: "F8_E4M3", shape: vec![3, 2, 8], bytes: q.codes.len() },
        ],
        HashMap::new(),
    )
    .unwrap();
    let b = [head, token_bytes(&s), q.codes].concat();
    assert!(Fp8.decode(&b, "f").unwrap_err().message.contains("without `hidden_states_scales`"));
}

#[test]
fn the_format_is_chosen_by_name_and_records_its_stored_dtype() {
    let f = by_name("fp8", None).unwrap();
    assert_eq!((f.name(), f.stored_dtype(DType::BF16)), ("fp8", STORED));
    assert!(by_name("fp8", Some(3)).err().is_some_and(|e| e.message.contains("hscapture format only")));
    let s = sample(2);
    assert_eq!(f.encode(&s, &identity()).unwrap().concat(), file(&s), "a file is a function of its sample");
}
