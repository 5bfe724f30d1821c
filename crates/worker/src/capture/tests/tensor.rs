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
