use super::*;

#[test]
fn probe_never_panics_and_agrees_with_is_available() {
    let p = probe();
    assert_eq!(is_available(), matches!(p, Availability::Devices(_)));
}
