use super::*;

#[test]
fn file_appears_whole_and_leftovers_are_removed() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("x.bin");
    assert_eq!(write_atomic(&p, true, |w| w.write_all(b"hello")).unwrap(), 5);
    assert_eq!(fs::read(&p).unwrap(), b"hello");
    let e = write_atomic(&d.path().join("y.bin"), false, |w| {
        w.write_all(b"partial")?;
        Err(std::io::Error::other("boom"))
    })
    .unwrap_err();
    assert!(e.message.contains("boom"));
    let names: Vec<_> = fs::read_dir(d.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from("x.bin")], "no partial file is left behind");
}
