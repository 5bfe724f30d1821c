use super::*;

fn desc(shape: &[usize], strides: &[i64]) -> TensorDesc {
    TensorDesc { ptr: 8, shape: shape.to_vec(), strides: strides.to_vec(), dtype: DType::F32, device: Device::Cpu }
}

#[test]
fn layouts() {
    assert_eq!(desc(&[5, 8], &[8, 1]).row_layout("x").unwrap(), 8);
    assert_eq!(desc(&[5, 8], &[16, 1]).row_layout("x").unwrap(), 16);
    assert_eq!(desc(&[1, 5, 8], &[40, 8, 1]).row_layout("x").unwrap(), 8);
    assert_eq!(desc(&[1, 5, 8], &[40, 8, 1]).rows(), 5);
    let e = desc(&[5, 8], &[1, 5]).row_layout("layer 3").unwrap_err();
    assert!(e.message.contains("contiguous"), "{e}");
    assert!(desc(&[8], &[1]).row_layout("x").is_err());
    assert!(desc(&[2, 5, 8], &[80, 8, 1]).row_layout("x").is_err());
}

#[test]
fn sizes_from_the_caller_are_checked_not_wrapped() {
    let huge = usize::MAX / 2;
    let e = TensorDesc::new(8, vec![huge, 4], vec![4, 1], DType::F32, Device::Cpu, "layer 1").unwrap_err();
    assert!(e.message.contains("more bytes than memory can hold"), "{e}");
    assert!(TensorDesc::new(8, vec![3, 4], vec![i64::MIN, 1], DType::F32, Device::Cpu, "x").is_err(), "stride out of range");
    let ok = TensorDesc::new(8, vec![3, 4], vec![4, 1], DType::F32, Device::Cpu, "x").unwrap();
    assert_eq!((ok.rows(), ok.row_layout("x").unwrap()), (3, 4));
    // A stride that, times the rows asked for, passes the end of the address space: refused before any view.
    let wide = desc(&[3, 4], &[i64::MAX / 2, 1]);
    // SAFETY: refused before any memory is read.
    let e = unsafe { wide.cpu_rows("layer 2", 3) }.err().unwrap();
    assert!(e.message.contains("exceed the address space"), "{}", e.message);
    // Leading dimensions whose stride product overflows do not collapse (no wrap into a match).
    assert!(desc(&[2, usize::MAX / 4, 4], &[4, i64::MAX / 2, 1]).row_layout("x").is_err());
}
