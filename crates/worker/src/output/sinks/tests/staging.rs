use super::*;
use std::fs::TryLockError;

#[test]
fn ids_of_any_length_and_bytes_get_bounded_safe_distinct_names() {
    assert_eq!(file_name("cmpl-abc-0-1f2e3d4c"), "cmpl-abc-0-1f2e3d4c.safetensors", "vLLM's ids stay readable");
    let long = format!("cmpl-{}-0-1f2e3d4c", "x".repeat(300));
    let names = [
        file_name("x/1"),
        file_name("x_1"),
        file_name("x 1"),
        file_name(&long),
        file_name(&format!("{long}y")),
        file_name(".."),
        file_name(""),
        file_name("é/../../etc"),
        file_name(&"/".repeat(4000)),
    ];
    for n in &names {
        assert!(n.len() + ".lock".len() + ".partial-4294967295-18446744073709551615".len() < 255, "{n}: too long");
        let safe = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '~');
        assert!(n.chars().all(safe) && !n.starts_with('.'), "{n}: not a safe name");
    }
    let distinct: std::collections::HashSet<_> = names.iter().collect();
    assert_eq!(distinct.len(), names.len(), "distinct ids share a name: {names:?}");
    assert_ne!(file_name("x_1~00"), file_name("x/1"), "a verbatim id never takes a digest name's form");
}

#[test]
fn flock_is_checked_where_the_files_go() {
    let d = tempfile::tempdir().unwrap();
    check_flock(d.path()).unwrap();
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0, "the probe leaves nothing behind");
    let e = check_flock(&d.path().join("missing")).unwrap_err();
    assert!(e.message.contains("must exist and be writable"), "{e}");
}

#[test]
fn ids_that_differ_only_in_unsafe_characters_hold_their_own_locks() {
    // Before, `x/1` and `x_1` shared `x_1.safetensors.lock`: this process would wait on a flock it held itself.
    let d = tempfile::tempdir().unwrap();
    let locks = Locks::new(d.path(), SlowDisk::default());
    locks.hold("x/1", None).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let l = std::sync::Arc::new(locks);
    let l2 = std::sync::Arc::clone(&l);
    std::thread::spawn(move || tx.send(l2.hold("x_1", None).is_ok()).unwrap());
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(true), "the second request waited on the first's lock");
    assert_eq!(l.held(), 2);
}

#[test]
fn a_lock_is_held_until_released_and_its_file_left_for_the_client() {
    let d = tempfile::tempdir().unwrap();
    let locks = Locks::new(d.path(), SlowDisk::default());
    assert_eq!(file_name("cmpl-a1-0-b2"), "cmpl-a1-0-b2.safetensors");
    locks.hold("r-1", Some(3)).unwrap();
    let path = lock_path(&d.path().join(file_name("r-1")));
    let other = File::open(&path).unwrap();
    assert!(matches!(other.try_lock(), Err(TryLockError::WouldBlock)), "a client waits while the writer holds it");
    locks.release("r-1");
    other.try_lock().unwrap();
    assert!(path.exists(), "the client removes the lock file, not the writer");
    assert_eq!(locks.held(), 0);
    locks.hold("r-2", None).unwrap();
    locks.hold("r-2", Some(5)).unwrap(); // held already: not locked twice (which would wait for itself)
    assert_eq!((locks.waiting_rows(), locks.take_completed_rows(), locks.take_completed_rows()), (5, 8, 0));
    locks.abandon("r-2");
    assert!(!lock_path(&d.path().join(file_name("r-2"))).exists(), "an abandoned request's lock file is removed");
    locks.abandon("r-1"); // not held (released before): its file is the client's, left alone
    assert!(path.exists());
}

#[test]
fn room_is_waited_for_among_complete_samples_only() {
    let d = tempfile::tempdir().unwrap();
    let locks = std::sync::Arc::new(Locks::new(d.path(), SlowDisk::default()));
    locks.hold("generating", None).unwrap(); // completes after many steps: never waited for
    locks.hold("a", Some(10)).unwrap();
    locks.hold("b", Some(10)).unwrap();
    locks.wait_for_room(20, STALL_DEADLINE, || None).unwrap();
    let l = std::sync::Arc::clone(&locks);
    let writer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        l.release("a");
    });
    let t = Instant::now();
    locks.wait_for_room(10, STALL_DEADLINE, || None).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(90), "waited for a's file");
    writer.join().unwrap();
    let e = locks.wait_for_room(0, STALL_DEADLINE, || Some(crate::core_err!(Output, "the writer failed"))).unwrap_err();
    assert!(e.message.contains("the writer failed"), "a failed capture ends the wait: {e}");
}

#[test]
fn a_slow_disk_holds_each_write_while_its_hold_file_exists() {
    let d = tempfile::tempdir().unwrap();
    let hold = d.path().join("hold");
    std::fs::write(&hold, b"").unwrap();
    let disk = SlowDisk { delay: Duration::from_millis(20), hold_while: Some(hold.clone()) };
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        disk.wait();
        tx.send(()).unwrap();
    });
    assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "held while the file exists");
    std::fs::remove_file(&hold).unwrap();
    rx.recv_timeout(Duration::from_secs(30)).expect("released once it is removed");
    waiter.join().unwrap();
}

#[test]
fn a_backlog_that_does_not_drain_is_reported_after_the_deadline_not_waited_on_forever() {
    let d = tempfile::tempdir().unwrap();
    let locks = Locks::new(d.path(), SlowDisk::default());
    locks.hold("a", Some(10)).unwrap();
    assert_eq!(locks.wait_for_room(10, Duration::from_secs(5), || None).unwrap(), None, "within the backlog");
    let t = Instant::now();
    let stalled = locks.wait_for_room(4, Duration::from_millis(200), || None).unwrap().expect("stalled");
    assert!(t.elapsed() >= Duration::from_millis(200) && t.elapsed() < Duration::from_secs(5));
    assert_eq!((stalled.files, stalled.rows, stalled.limit), (1, 10, 4));
    assert!(stalled.to_string().contains("the disk is full, hung"), "{stalled}");
    let e = locks.wait_for_room(4, Duration::from_secs(60), || Some(core_err!(Output, "the writer failed")));
    assert!(e.is_err(), "a failed capture ends the wait at once");
}

/// A per-request file sink in `root`, as a server's worker opens it.
fn staging_sink(root: &Path) -> (std::sync::Arc<Locks>, crate::output::sinks::sink::FileSink) {
    use crate::output::sinks::sink::{FileSink, Layout};
    let locks = std::sync::Arc::new(Locks::new(root, SlowDisk::default()));
    let identity = crate::output::sinks::writer::tests::identity();
    let format = crate::output::formats::by_name("hscapture", None).unwrap();
    let layout = Layout::Staging(std::sync::Arc::clone(&locks));
    let sink = FileSink::with_layout(root, format, identity, crate::output::atomic::Durability::Rename, layout).unwrap();
    (locks, sink)
}

fn request_sample(req: &str) -> crate::sample::Sample {
    crate::sample::Sample {
        key: crate::sample::SampleKey::Request(req.into()),
        req_id: req.into(),
        token_ids: vec![1, 2, 3],
        data: vec![1u8; 3 * 2 * 4 * 4],
        rows: 3,
        slots: 2,
        width: 4,
        dtype: hscapture_kernels::DType::F32,
        loss_mask: None,
        scales: None,
    }
}

fn names(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
fn a_file_that_cannot_be_written_fails_its_request_alone_and_lets_its_client_go() {
    use crate::output::sinks::sink::{NotStored, Sink};
    let d = tempfile::tempdir().unwrap();
    let (locks, sink) = staging_sink(d.path());
    locks.hold("bad", Some(3)).unwrap();
    locks.hold("good", Some(3)).unwrap();
    // Its name is taken by a directory with something in it: the rename into place fails, as a full disk or a
    // partial file removed under the writer fails the write.
    let target = d.path().join(file_name("bad"));
    std::fs::create_dir_all(target.join("x")).unwrap();
    let Err(NotStored::Request(e)) = sink.put(&request_sample("bad")) else {
        panic!("a per-request file that cannot be written fails its request, not the capture")
    };
    assert!(e.message.contains(&file_name("bad")), "{e}");
    let lock = File::open(lock_path(&target)).unwrap();
    lock.try_lock().expect("the lock is released: the client stops waiting and finds no file");
    sink.put(&request_sample("good")).expect("the next request's file is written");
    assert!(d.path().join(file_name("good")).is_file());
    assert_eq!(locks.held(), 0);
    let left: Vec<String> = names(d.path()).into_iter().filter(|n| n.contains(".partial-")).collect();
    assert!(left.is_empty(), "no partial file is left behind: {left:?}");
}

#[test]
fn a_lock_that_cannot_be_taken_fails_its_request_alone_and_its_file_is_never_written() {
    use crate::output::sinks::sink::{NotStored, Sink};
    let d = tempfile::tempdir().unwrap();
    let (locks, sink) = staging_sink(d.path());
    // The lock file cannot be created (a directory holds its name; as a full disk or a removed directory fails it).
    let lock = lock_path(&d.path().join(file_name("r")));
    std::fs::create_dir(&lock).unwrap();
    locks.hold_or_fail("r", Some(3));
    assert_eq!(locks.held(), 0);
    let Err(NotStored::Request(e)) = sink.put(&request_sample("r")) else { panic!("the request fails alone") };
    assert!(e.message.contains("lock could not be taken") && e.message.contains("Is a directory"), "{e}");
    assert!(e.cause.is_some(), "the OS error stays its cause: {e:?}");
    assert!(!d.path().join(file_name("r")).exists(), "no file that no lock guarded");
    // A request held from its start (it captures its generated tokens) whose first hold failed stays failed, though
    // the lock could be taken when it completes: that comes after its response, whose client may have found nothing.
    let grown = lock_path(&d.path().join(file_name("g")));
    std::fs::create_dir(&grown).unwrap();
    locks.hold_or_fail("g", None);
    std::fs::remove_dir(&grown).unwrap();
    locks.hold_or_fail("g", Some(3));
    assert_eq!((locks.held(), locks.take_completed_rows()), (0, 0), "no lock, and no rows for the backlog to wait on");
    assert!(matches!(sink.put(&request_sample("g")), Err(NotStored::Request(_))));
    assert!(!d.path().join(file_name("g")).exists() && !grown.exists(), "nothing for nobody");
    // An aborted request's failed hold is forgotten with it.
    locks.hold_or_fail("r", None);
    locks.abandon("r");
    assert!(locks.take_unheld("r").is_none());
}
