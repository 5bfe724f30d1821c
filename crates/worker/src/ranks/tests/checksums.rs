use super::*;

#[test]
fn names_the_disagreeing_ranks() {
    assert!(verify_replicated(1, "TP", &[7, 7, 7]).is_ok());
    assert!(verify_replicated(1, "TP", &[]).is_ok());
    let e = verify_replicated(9, "TP", &[7, 7, 8, 7]).unwrap_err();
    assert_eq!(e.kind, crate::ErrorKind::RankMismatch);
    assert!(e.message.contains("step 9") && e.message.contains("ranks [2] disagree"), "{e}");
}
