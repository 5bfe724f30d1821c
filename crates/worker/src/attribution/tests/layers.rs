use super::*;

#[test]
fn after_range_and_points() {
    let p = LayerPlan::new(&[5, 2, 31], Convention::After, 32).unwrap();
    assert_eq!(p.ids, vec![2, 5, 31]);
    assert_eq!(p.points(), vec![CapturePoint::LayerOutput(2), CapturePoint::LayerOutput(5), CapturePoint::LayerOutput(31)]);
    let e = LayerPlan::new(&[32], Convention::After, 32).unwrap_err();
    assert!(e.message.contains("valid ids are 0..=31") && e.message.contains("`before`"), "{e}");
}

#[test]
fn before_range_and_points() {
    let p = LayerPlan::new(&[0, 32, 3], Convention::Before, 32).unwrap();
    assert_eq!(p.points(), vec![CapturePoint::Embeddings, CapturePoint::LayerOutput(2), CapturePoint::LayerOutput(31)]);
    assert!(LayerPlan::new(&[33], Convention::Before, 32).is_err());
}

#[test]
fn refuses_empty_duplicates_negative() {
    assert!(LayerPlan::new(&[], Convention::After, 4).unwrap_err().message.contains("empty"));
    assert!(LayerPlan::new(&[1, 1], Convention::After, 4).unwrap_err().message.contains("twice"));
    assert!(LayerPlan::new(&[-1], Convention::Before, 4).unwrap_err().message.contains("negative"));
}

#[test]
fn conventions_are_one_apart() {
    let after = LayerPlan::new(&[0, 3], Convention::After, 4).unwrap();
    assert_eq!(after.ids_in(Convention::Before), vec![Some(1), Some(4)]);
    let before = LayerPlan::new(&[0, 4], Convention::Before, 4).unwrap();
    assert_eq!(before.ids_in(Convention::After), vec![None, Some(3)]);
    for id in 0..4 {
        let a = LayerPlan::new(&[id], Convention::After, 4).unwrap().point(0);
        let b = LayerPlan::new(&[id + 1], Convention::Before, 4).unwrap().point(0);
        assert_eq!(a, b, "after {id} must be captured where before {} is", id + 1);
    }
}

#[test]
fn defaults() {
    assert_eq!(default_ids(Convention::After, 32).unwrap(), vec![2, 16, 29, 31]);
    assert_eq!(default_ids(Convention::Before, 32).unwrap(), vec![2, 16, 29, 32]);
    assert_eq!(default_ids(Convention::Before, 4).unwrap(), vec![1, 2, 4]);
    assert_eq!(default_ids(Convention::After, 1).unwrap(), vec![0]);
    for c in [Convention::After, Convention::Before] {
        let e = default_ids(c, 0).unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::Config, "no wrapped-around ids for a model without layers");
    }
}
