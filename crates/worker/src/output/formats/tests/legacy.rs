use super::*;
use crate::output::ledger::record::file_checksum;

fn sample(rows: usize, slots: usize, width: usize, dtype: DType, mask: Option<Vec<u8>>) -> Sample {
    let n = rows * slots * width * dtype.size();
    Sample {
        key: SampleKey::Index(7),
        req_id: "r".into(),
        token_ids: (0..rows as i64).map(|t| t * 1000 + 3).collect(),
        data: (0..n).map(|i| (i * 7 % 251) as u8).collect(),
        rows,
        slots,
        width,
        dtype,
        loss_mask: mask,
        scales: None,
    }
}

fn identity() -> Identity {
    Identity {
        format: "legacy".into(),
        model: "m".into(),
        layer_ids: vec![1, 2],
        convention: "after".into(),
        dtype: "bfloat16".into(),
        hidden_size: 4,
        num_hidden_layers: 4,
        layer_output: "sum".into(),
    }
}

#[test]
fn a_sample_round_trips_with_and_without_zip64() {
    for (dtype, mask) in [(DType::BF16, Some(vec![0, 1, 1])), (DType::F32, None), (DType::F16, None)] {
        let s = sample(3, 2, 4, dtype, mask.clone());
        for force in [false, true] {
            let bytes = Legacy.archive(&s, force).unwrap().concat();
            let back = Legacy.decode(&bytes, "t").unwrap();
            assert_eq!((back.token_ids.clone(), back.shape, back.dtype), (s.token_ids.clone(), [3, 2, 4], dtype));
            assert_eq!(back.data, s.data, "the [L, n, H] bytes come back from per-layer storages");
            assert_eq!(back.loss_mask, Some(mask.clone().unwrap_or(vec![1, 1, 1])), "an absent mask is all ones");
        }
    }
    let s = sample(2, 1, 2, DType::F32, None);
    assert_eq!(Legacy.file(&s.key), "data_7.pt");
    assert_eq!(Legacy.index_of("data_7.pt"), Some(7));
    assert_eq!(Legacy.index_of(".data_7.pt.partial-1-0"), None);
    let a = Legacy.encode(&s, &identity()).unwrap().concat();
    let b = Legacy.encode(&s, &identity()).unwrap().concat();
    assert_eq!(file_checksum(&a), file_checksum(&b), "the archive is a function of the sample");
}

#[test]
fn large_counts_are_pickled_as_long_integers() {
    let mut p = Pickle(Vec::new());
    p.int(0x8000_0000);
    assert_eq!(p.0, vec![0x8a, 5, 0, 0, 0, 0x80, 0], "LONG1 with a sign byte");
    let mut p = Pickle(Vec::new());
    p.int(70_000);
    assert_eq!(p.0, vec![b'J', 0x70, 0x11, 0x01, 0x00]);
}

#[test]
fn an_archive_that_is_not_exactly_hscapture_s_is_refused() {
    let s = sample(3, 2, 4, DType::BF16, None);
    let good = Legacy.archive(&s, false).unwrap().concat();
    let pkl = good.windows(9).position(|w| w == b"input_ids").unwrap();
    let mut renamed = good.clone();
    renamed[pkl] = b'X';
    let e = Legacy.decode(&renamed, "t").unwrap_err();
    assert!(e.message.contains("CRC") || e.message.contains("pickle"), "{e}");
    assert!(Legacy.decode(b"not a zip at all, just text of some length", "t").is_err());
    let mismatched = sample(3, 2, 4, DType::BF16, Some(vec![1, 1]));
    assert!(Legacy.archive(&mismatched, false).unwrap_err().message.contains("loss mask of 2 values for 3 tokens"));
}
