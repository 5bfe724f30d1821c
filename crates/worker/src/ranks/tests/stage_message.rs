use super::*;
use crate::error::ErrorKind;

fn msg() -> StageMessage {
    StageMessage {
        step: 7,
        rows: 3,
        row_bytes: 4,
        parts: vec![
            SlotPart { slot: 0, data: (0..12).collect(), row_sums: vec![1, 2, 3], nonfinite: vec![0, 1, 0] },
            SlotPart { slot: 2, data: (12..24).collect(), row_sums: vec![u64::MAX, 0, 9], nonfinite: vec![0, 0, 5] },
        ],
    }
}

#[test]
fn round_trips() {
    let m = msg();
    assert_eq!(StageMessage::decode(&m.encode()).unwrap(), m);
    let empty = StageMessage { step: 1, rows: 0, row_bytes: 8, parts: vec![] };
    assert_eq!(StageMessage::decode(&empty.encode()).unwrap(), empty);
}

#[test]
fn refuses_truncated_foreign_and_padded_messages() {
    let b = msg().encode();
    for cut in [0, 3, 10, b.len() - 1] {
        let e = StageMessage::decode(&b[..cut]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::RankMismatch, "{cut}: {e}");
    }
    let mut foreign = b.clone();
    foreign[0] = b'X';
    assert!(StageMessage::decode(&foreign).unwrap_err().message.contains("another message"));
    let mut padded = b;
    padded.push(0);
    assert!(StageMessage::decode(&padded).unwrap_err().message.contains("trailing"));
}
