use super::*;
use std::path::Path;

#[test]
fn file_appears_whole_and_leftovers_are_removed() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("x.bin");
    let written = write_atomic(&p, true, |w| w.write_all(b"hello")).unwrap();
    assert_eq!(written.bytes, 5);
    assert_eq!(fs::read(&p).unwrap(), b"hello");
    assert_eq!(written.checksum, crate::output::ledger::record::file_checksum(b"hello"), "the checksum is of the bytes written");
    let e = write_atomic(&d.path().join("y.bin"), false, |w| {
        w.write_all(b"partial")?;
        Err(std::io::Error::other("boom"))
    })
    .unwrap_err();
    assert!(e.message.contains("boom"));
    let names: Vec<_> = fs::read_dir(d.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from("x.bin")], "no partial file is left behind");
}

#[test]
fn writeback_hands_the_placed_file_over_and_syncs_it_wherever_it_went() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("r.safetensors");
    let (written, file) = write_placed(&p, Durability::Writeback, |w| w.write_all(b"rows")).unwrap();
    assert_eq!(written.bytes, 4);
    assert_eq!(fs::read(&p).unwrap(), b"rows", "in place before the writeback");
    let moved = d.path().join("moved.safetensors");
    fs::rename(&p, &moved).unwrap(); // a client takes the file at once
    writeback(file.expect("writeback returns the open file"), &moved).unwrap();
    assert_eq!(fs::read(&moved).unwrap(), b"rows");
    for level in [Durability::Rename, Durability::Fsync] {
        let (_, file) = write_placed(&d.path().join(format!("{level:?}")), level, |w| w.write_all(b"x")).unwrap();
        assert!(file.is_none(), "{level:?} leaves nothing to write back");
    }
}

#[test]
fn a_full_disk_is_named_and_leaves_nothing_behind() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("hs_0.safetensors");
    let e = write_atomic(&p, true, |w| {
        w.write_all(&[0u8; 4096])?;
        Err(std::io::Error::from_raw_os_error(28)) // ENOSPC, as a full file system reports it
    })
    .unwrap_err();
    assert_eq!(e.kind, crate::ErrorKind::Output);
    assert!(e.message.contains("the disk is full"), "{e}");
    assert_eq!(fs::read_dir(d.path()).unwrap().count(), 0, "neither the file nor its partial copy remains");
}

#[test]
fn writeback_syncs_the_data_and_reports_a_sync_that_fails() {
    // A character device cannot be synchronised (fdatasync: EINVAL): a writeback that skipped the sync, or dropped its
    // error, would pass here.
    let Ok(f) = fs::OpenOptions::new().write(true).open("/dev/full") else {
        return;
    };
    let e = writeback(f, Path::new("/dev/full")).unwrap_err();
    assert_eq!(e.kind, crate::ErrorKind::Output);
    assert!(e.message.contains("cannot write back"), "{e}");
}

#[test]
fn a_directory_that_cannot_be_flushed_is_an_error() {
    let e = sync_dir(Path::new("/nonexistent/hscapture")).unwrap_err();
    assert_eq!(e.kind, crate::ErrorKind::Output);
    assert!(e.message.contains("cannot open the directory"), "{e}");
    assert!(is_partial(".hs_1.safetensors.partial-12-0") && !is_partial("hs_1.safetensors"));
}

#[test]
fn an_io_error_keeps_its_kind_and_os_error_number_as_its_cause() {
    use crate::error::Cause;
    let d = tempfile::tempdir().unwrap();
    let e = write_atomic(&d.path().join("missing/x.bin"), false, |w| w.write_all(b"x")).unwrap_err();
    match &e.cause {
        Some(Cause::Io { kind, errno, .. }) => {
            assert_eq!(*kind, std::io::ErrorKind::NotFound);
            assert_eq!(*errno, Some(2), "ENOENT, as the OS said it");
        }
        other => panic!("expected the I/O error as the cause, found {other:?}"),
    }
    assert!(std::error::Error::source(&e).is_some(), "the standard error chain reaches it too");
}
