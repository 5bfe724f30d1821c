use super::*;

#[test]
fn order_of_elements_matters() {
    assert_ne!(row_checksum([1, 2, 3]), row_checksum([3, 2, 1]));
}

#[test]
fn one_bit_changes_the_sum() {
    let a = row_checksum((0..4096u64).map(|x| x * 7));
    let b = row_checksum((0..4096u64).map(|x| if x == 1000 { (x * 7) ^ 1 } else { x * 7 }));
    assert_ne!(a, b);
}

#[test]
fn rows_are_keyed_by_slot_and_position() {
    assert_ne!(combine_row(5, 0, 1), combine_row(5, 1, 0));
    assert_ne!(combine_row(5, 0, 1), combine_row(5, 0, 2));
}
