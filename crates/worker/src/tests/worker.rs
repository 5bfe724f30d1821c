use super::*;
use crate::attribution::layers::{Convention, LayerPlan};
use crate::attribution::plan::NewRequest;
use crate::capture::tensor::Device;
use hscapture_kernels::DType;
use std::path::PathBuf;

fn cfg(assemble: bool) -> SessionConfig {
    SessionConfig {
        layers: LayerPlan::new(&[1], Convention::After, 4).unwrap(),
        hidden_size: 2,
        model_dtype: DType::F32,
        out_dtype: DType::F32,
        assemble,
    }
}

fn files(root: &std::path::Path) -> Files {
    Files { root: root.into(), format: "hscapture".into(), compress: None, durability: crate::output::atomic::Durability::Rename }
}

/// A capture directory at `root`, or samples kept in memory.
fn out(root: Option<PathBuf>) -> OutputSettings {
    let destination = match root {
        Some(r) => Destination::Directory(files(&r)),
        None => Destination::Memory,
    };
    OutputSettings {
        destination,
        model: "m".into(),
        layer_output: "sum".into(),
        threads: 2,
        queue: 2,
        max_growing_sample: u64::MAX,
        outputs_refused: None,
    }
}

/// Per-request files under `root`, at most `backlog` bytes of finished samples waiting for them at a release.
fn staged(root: &std::path::Path, backlog: u64) -> OutputSettings {
    let destination = Destination::Staging {
        files: files(root),
        backlog,
        collect_within: crate::output::sinks::janitor::COLLECT_WITHIN,
        slow_disk: Default::default(),
    };
    OutputSettings { destination, ..out(None) }
}

/// A step's input scheduling one new request's whole prompt.
fn whole_prompt(id: &str, prompt: Vec<i64>, sample: Option<u64>) -> StepInput {
    let n = prompt.len();
    StepInput {
        new_requests: vec![NewRequest {
            req_id: id.into(),
            prompt_token_ids: prompt,
            num_computed_tokens: 0,
            sample,
            loss_mask: None,
            max_tokens: None,
        }],
        num_scheduled: vec![(id.into(), n)],
        total_tokens: n,
        ..Default::default()
    }
}

/// A step, then its release (as the caller does once the ranks' meeting passed).
fn step(w: &mut WorkerSession, i: u64) -> Vec<StepReport> {
    let r = step_unreleased(w, i);
    w.release().unwrap();
    r
}

fn step_unreleased(w: &mut WorkerSession, i: u64) -> Vec<StepReport> {
    let id = format!("r{i}");
    w.begin_step(whole_prompt(&id, vec![1, 2, 3], Some(i))).unwrap();
    w.plan(&[id], None).unwrap();
    let h = [0.5f32, 1.5, 2.5, 3.5, 4.5, 5.5];
    let t = TensorDesc { ptr: h.as_ptr() as usize, shape: vec![3, 2], strides: vec![2, 1], dtype: DType::F32, device: Device::Cpu };
    // SAFETY: `h` lives for the call and nobody writes it.
    unsafe { w.capture(0, None, &t, None, 0).unwrap() };
    w.end_step().unwrap()
}

#[test]
fn samples_go_to_files_or_memory_and_the_writer_finishes() {
    let d = tempfile::tempdir().unwrap();
    for background in [false, true] {
        let root = d.path().join(format!("bg{background}"));
        let mut w = WorkerSession::new(cfg(true), out(Some(root.clone()))).unwrap();
        if background {
            w.set_background(2).unwrap();
        }
        let r = step(&mut w, 0);
        assert_eq!((r.len(), r[0].rows), (1, 3));
        step(&mut w, 1);
        let mut recs = w.drain().unwrap();
        recs.extend(w.finish().unwrap());
        assert_eq!(recs.len(), 2, "background {background}");
        assert!(root.join("hidden_states/hs_1.safetensors").exists());
    }
    let mut mem = WorkerSession::new(cfg(true), out(None)).unwrap();
    step(&mut mem, 4);
    assert_eq!(mem.take_samples().unwrap().len(), 1);
    let mut verifier = WorkerSession::new(cfg(false), out(Some(d.path().join("nothing")))).unwrap();
    assert_eq!(step(&mut verifier, 0)[0].completed, 0, "a verifying rank keeps no sample");
    assert!(!d.path().join("nothing").exists(), "and opens no output");
}

#[test]
fn settings_out_of_range_are_refused_before_anything_starts() {
    let d = tempfile::tempdir().unwrap();
    let bad = |f: fn(&mut OutputSettings)| {
        let mut o = out(Some(d.path().into()));
        f(&mut o);
        WorkerSession::new(cfg(true), o).err().map(|e| e.message).unwrap_or_default()
    };
    assert!(bad(|o| o.threads = 0).contains("writer threads"));
    assert!(bad(|o| o.queue = 0).contains("writer queue"));
    let compress = |o: &mut OutputSettings| {
        if let Destination::Directory(f) = &mut o.destination {
            f.compress = Some(23);
        }
    };
    let parquet = |o: &mut OutputSettings| {
        if let Destination::Directory(f) = &mut o.destination {
            f.format = "parquet".into();
        }
    };
    assert!(bad(compress).contains("zstd takes 1..=22"));
    assert!(bad(parquet).contains("unknown format"));
    assert!(!d.path().join(crate::output::ledger::journal::FILE).exists(), "no journal for a refused session");
}

#[test]
fn a_staged_file_s_lock_is_taken_when_its_step_ends_and_released_once_it_is_in_place() {
    use std::fs::{File, TryLockError};
    let d = tempfile::tempdir().unwrap();
    let o = staged(d.path(), 1 << 30);
    let mut w = WorkerSession::new(cfg(true), o).unwrap();
    w.set_background(2).unwrap();
    let hold = w.session_mut().hold_assembler_for_test();
    step(&mut w, 0); // the step ends: r0's prompt is complete, its rows wait on the held assembler thread
    let lock = d.path().join("r0.safetensors.lock");
    let probe = File::open(&lock).expect("the lock exists as the step ends, before any answer for r0");
    assert!(matches!(probe.try_lock(), Err(TryLockError::WouldBlock)), "and is held while the file is not written");
    assert!(!d.path().join("r0.safetensors").exists());
    drop(hold);
    w.drain().unwrap();
    probe.try_lock().expect("released once the file is in place");
    assert!(d.path().join("r0.safetensors").exists() && lock.exists(), "the client removes the lock file");
    assert!(!d.path().join(crate::output::ledger::journal::FILE).exists(), "no journal in a staging directory");
    w.finish().unwrap();
}

#[derive(Default)]
struct MemoryStore(std::sync::Mutex<Vec<(String, usize)>>);

impl crate::output::sinks::store::ObjectStore for MemoryStore {
    fn put(&self, key: &str, bytes: &[u8]) -> crate::error::CoreResult<()> {
        self.0.lock().unwrap().push((key.to_string(), bytes.len()));
        Ok(())
    }
}

#[test]
fn samples_go_to_an_object_store_as_packed_objects() {
    use crate::output::sinks::packed::PackedLayout;
    let store = std::sync::Arc::new(MemoryStore::default());
    let o = OutputSettings { destination: Destination::Store(store.clone()), ..out(None) };
    let mut w = WorkerSession::new(cfg(true), o.clone()).unwrap();
    step(&mut w, 0);
    step(&mut w, 1);
    assert!(w.drain().unwrap().is_empty(), "no ledger: the objects are the client's");
    let total = PackedLayout::of(3, 1, 2, DType::F32).unwrap().total;
    let mut put = store.0.lock().unwrap().clone();
    put.sort();
    assert_eq!(put, [("r0".to_string(), total), ("r1".to_string(), total)]);
    w.finish().unwrap();

    let mut v = WorkerSession::new(cfg(false), o).unwrap(); // a verifying rank stores nothing
    step(&mut v, 2);
    assert_eq!(store.0.lock().unwrap().len(), 2, "a verifying rank put nothing");
}

#[test]
fn an_aborted_request_with_outputs_gives_up_its_lock_and_its_lock_file() {
    let d = tempfile::tempdir().unwrap();
    let o = staged(d.path(), 1 << 30);
    let mut w = WorkerSession::new(cfg(true), o).unwrap();
    let first = StepInput {
        new_requests: vec![NewRequest {
            req_id: "q".into(),
            prompt_token_ids: vec![1, 2, 3, 4],
            num_computed_tokens: 0,
            sample: None,
            loss_mask: None,
            max_tokens: None,
        }],
        num_scheduled: vec![("q".into(), 2)],
        total_tokens: 2,
        with_outputs: vec!["q".into()],
        ..Default::default()
    };
    w.begin_step(first).unwrap();
    w.plan(&["q".to_string()], None).unwrap();
    let h = [0.5f32, 1.5, 2.5, 3.5];
    let t = TensorDesc { ptr: h.as_ptr() as usize, shape: vec![2, 2], strides: vec![2, 1], dtype: DType::F32, device: Device::Cpu };
    // SAFETY: `h` lives for the call and nobody writes it.
    unsafe { w.capture(0, None, &t, None, 0).unwrap() };
    w.end_step().unwrap();
    let lock = d.path().join("q.safetensors.lock");
    assert!(lock.exists(), "held from the request's first step (its file would complete after its response)");
    // q is aborted mid-prompt: the next step reports it finished, without output tokens.
    w.begin_step(StepInput { finished: vec!["q".into()], ..Default::default() }).unwrap();
    w.end_step().unwrap();
    assert!(!lock.exists(), "no response names its file: the lock and its file go");
    w.finish().unwrap();
}

#[test]
fn samples_are_stored_only_once_their_steps_are_released() {
    // The ranks meet after each call that accounts steps; only then does the caller release them. A step
    // whose meeting failed is never released: its samples are neither written nor journaled.
    let d = tempfile::tempdir().unwrap();
    for background in [false, true] {
        let root = d.path().join(format!("bg{background}"));
        let mut w = WorkerSession::new(cfg(true), out(Some(root.clone()))).unwrap();
        if background {
            w.set_background(2).unwrap();
        }
        step(&mut w, 0);
        step_unreleased(&mut w, 1); // its meeting fails: never released
        let recs = w.drain().unwrap();
        assert_eq!(recs.iter().map(|r| r.index).collect::<Vec<_>>(), [Some(0)], "background {background}");
        let mut more = w.finish().unwrap();
        more.extend(recs);
        assert_eq!(more.len(), 1, "the unreleased sample is dropped at the end, background {background}");
        assert!(root.join("hidden_states/hs_0.safetensors").exists());
        assert!(!root.join("hidden_states/hs_1.safetensors").exists(), "background {background}");
        let journal = std::fs::read_to_string(root.join(crate::output::ledger::journal::FILE)).unwrap();
        assert!(journal.contains("hs_0.") && !journal.contains("hs_1."), "journaled only what was released: {journal}");
    }
    let mut mem = WorkerSession::new(cfg(true), out(None)).unwrap();
    step_unreleased(&mut mem, 4);
    assert!(mem.take_samples().unwrap().is_empty(), "kept for the caller only once released");
    mem.release().unwrap();
    assert_eq!(mem.take_samples().unwrap().len(), 1);
}

#[test]
fn a_release_waits_while_the_staged_backlog_is_over_its_bound() {
    // Per-request files on a slow disk (each file 150 ms late): a release returns only once at most
    // `staging_backlog` bytes of complete samples wait for their files, so a response's file follows it within the
    // time that backlog takes to write (speculators' client gives up on a lock after 10 s).
    let d = tempfile::tempdir().unwrap();
    let mut o = staged(d.path(), 0); // no sample may wait: each release waits for every released file
    if let Destination::Staging { slow_disk, .. } = &mut o.destination {
        slow_disk.delay = std::time::Duration::from_millis(150);
    }
    let mut w = WorkerSession::new(cfg(true), o).unwrap();
    w.set_background(2).unwrap();
    let t = std::time::Instant::now();
    step(&mut w, 0);
    assert!(t.elapsed() >= std::time::Duration::from_millis(140), "the release waited for r0's file");
    assert!(d.path().join("r0.safetensors").exists(), "in place when the step's responses can go out");
    w.finish().unwrap();
}

#[test]
fn a_release_does_not_wait_for_the_samples_of_the_step_still_in_flight() {
    // Overlapped device steps: a step is collected at the next one's end, so its samples cannot be written
    // before then; waiting for them at its own release would wait forever.
    use crate::capture::session::tests::HostDevice;
    let d = tempfile::tempdir().unwrap();
    let o = staged(d.path(), 0);
    let cfg4 = SessionConfig { hidden_size: 4, ..cfg(true) };
    let mut w = WorkerSession::new(cfg4, o).unwrap();
    w.set_background(2).unwrap();
    w.set_device(Box::new(HostDevice::new(1, 16, 3)), 1).unwrap();
    w.begin_step(whole_prompt("r0", vec![1, 2, 3], None)).unwrap();
    w.release().unwrap();
    w.plan(&["r0".to_string()], None).unwrap();
    let h: Vec<f32> = (0..12).map(|i| i as f32 + 0.5).collect();
    let t = TensorDesc { ptr: h.as_ptr() as usize, shape: vec![3, 4], strides: vec![4, 1], dtype: DType::F32, device: Device::Cuda(0) };
    // SAFETY: `h` lives for the call; the stand-in device copies it at once.
    unsafe { w.capture(0, None, &t, None, 0).unwrap() };
    w.end_step().unwrap();
    w.release().unwrap(); // returns: r0's rows are in flight (its file needs the next step)
    assert!(!d.path().join("r0.safetensors").exists());
    w.begin_step(StepInput { finished: vec!["r0".into()], ..Default::default() }).unwrap();
    w.release().unwrap();
    w.end_step().unwrap(); // collects r0's step
    w.release().unwrap(); // and waits for its file (no backlog allowed)
    assert!(d.path().join("r0.safetensors").exists(), "in place once the step that collected it is released");
    w.finish().unwrap();
}

#[test]
fn a_layer_that_is_one_row_for_every_token_is_refused_alone_and_not_written() {
    // Before, this sample's DegenerateStatesError stopped the whole capture (a server with it). Untrained tokens whose
    // embeddings are all zero make such states legitimately: the request fails alone, the next one is written.
    let d = tempfile::tempdir().unwrap();
    let mut w = WorkerSession::new(cfg(true), out(Some(d.path().into()))).unwrap();
    let step = |w: &mut WorkerSession, id: &str, sample: u64, h: &[f32]| {
        w.begin_step(whole_prompt(id, vec![1, 2, 3], Some(sample))).unwrap();
        w.plan(&[id.to_string()], None).unwrap();
        let t = TensorDesc { ptr: h.as_ptr() as usize, shape: vec![3, 2], strides: vec![2, 1], dtype: DType::F32, device: Device::Cpu };
        // SAFETY: `h` lives for the call and nobody writes it.
        unsafe { w.capture(0, None, &t, None, 0).unwrap() };
        w.end_step().unwrap();
        w.release().unwrap();
    };
    step(&mut w, "r", 7, &[0.5f32, 1.5, 0.5, 1.5, 0.5, 1.5]); // three tokens, one row
    step(&mut w, "s", 8, &[0.5f32, 1.5, 2.5, 3.5, 4.5, 5.5]);
    let skipped = w.session_mut().take_skipped();
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert!(skipped[0].1 == "r" && skipped[0].2.contains("layer id 1") && skipped[0].2.contains("the same row"), "{skipped:?}");
    w.finish().unwrap();
    assert!(!d.path().join("hidden_states/hs_7.safetensors").exists());
    assert!(d.path().join("hidden_states/hs_8.safetensors").exists(), "the capture went on");
}

#[test]
fn a_run_of_degenerate_samples_is_the_captures_error() {
    // A hook on a tensor no layer computes makes every sample degenerate: that stops the capture, naming why.
    let d = tempfile::tempdir().unwrap();
    let mut w = WorkerSession::new(cfg(true), out(Some(d.path().into()))).unwrap();
    let h = [0.0f32; 6];
    let mut err = None;
    for k in 0..crate::capture::scatter::SYSTEMATIC as u64 {
        let id = format!("r{k}");
        w.begin_step(whole_prompt(&id, vec![1, 2, 3], Some(k))).unwrap();
        w.plan(&[id], None).unwrap();
        let t = TensorDesc { ptr: h.as_ptr() as usize, shape: vec![3, 2], strides: vec![2, 1], dtype: DType::F32, device: Device::Cpu };
        // SAFETY: `h` lives for the call and nobody writes it.
        unsafe { w.capture(0, None, &t, None, 0).unwrap() };
        if let Err(e) = w.end_step() {
            err = Some((k, e));
            break;
        }
    }
    let (k, e) = err.expect("a run of degenerate samples must stop the capture");
    assert_eq!((k, e.kind), (crate::capture::scatter::SYSTEMATIC as u64 - 1, crate::error::ErrorKind::DegenerateStates));
    assert!(e.message.contains("all zeros") && e.message.contains("none sound between them"), "{e}");
}

#[test]
fn a_staged_request_with_degenerate_states_gives_up_its_lock_at_once() {
    // Background assembly checks the states after the step's release, when the response names the file already: its
    // lock is given up (and its lock file removed) right there, so the waiting client finds no file.
    let d = tempfile::tempdir().unwrap();
    let o = staged(d.path(), 1 << 30);
    let mut w = WorkerSession::new(cfg(true), o).unwrap();
    w.set_background(2).unwrap();
    w.begin_step(whole_prompt("bad", vec![1, 2, 3], None)).unwrap();
    w.plan(&["bad".to_string()], None).unwrap();
    let h = [0.0f32; 6];
    let t = TensorDesc { ptr: h.as_ptr() as usize, shape: vec![3, 2], strides: vec![2, 1], dtype: DType::F32, device: Device::Cpu };
    // SAFETY: `h` lives for the call and nobody writes it.
    unsafe { w.capture(0, None, &t, None, 0).unwrap() };
    w.end_step().unwrap();
    w.release().unwrap();
    let lock = d.path().join("bad.safetensors.lock");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while lock.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5)); // no later call into the session
    }
    assert!(!lock.exists() && !d.path().join("bad.safetensors").exists(), "the client finds neither file nor lock");
    w.finish().unwrap();
}

/// A step opening `r9`, which captures its generated tokens (its lock is held from this step, its file comes when it
/// finishes), beside `r0`'s whole prompt.
fn open_r9_beside_r0(w: &mut WorkerSession) {
    let mut opened = whole_prompt("r9", vec![7, 8], None);
    opened.with_outputs = vec!["r9".into()];
    opened.new_requests.extend(whole_prompt("r0", vec![1, 2, 3], None).new_requests);
    opened.num_scheduled = vec![("r9".into(), 2), ("r0".into(), 3)];
    opened.total_tokens = 5;
    w.begin_step(opened).unwrap();
    w.plan(&["r9".to_string(), "r0".to_string()], None).unwrap();
    let h: Vec<f32> = (0..10).map(|i| i as f32 + 0.5).collect();
    let t = TensorDesc { ptr: h.as_ptr() as usize, shape: vec![5, 2], strides: vec![2, 1], dtype: DType::F32, device: Device::Cpu };
    // SAFETY: `h` lives for the call and nobody writes it.
    unsafe { w.capture(0, None, &t, None, 0).unwrap() };
    w.end_step().unwrap();
}

#[test]
fn a_file_that_cannot_be_written_fails_its_request_alone_and_the_server_serves_on() {
    // Before, a failed write was the capture's: the engine stopped, and every request in flight failed with it (a
    // full disk, or a partial file removed under the writer, as the benchmark's own cleaner once did).
    use std::fs::File;
    let d = tempfile::tempdir().unwrap();
    let mut w = WorkerSession::new(cfg(true), staged(d.path(), 1 << 30)).unwrap();
    std::fs::create_dir_all(d.path().join("r0.safetensors/x")).unwrap(); // r0's file cannot be renamed into place
    open_r9_beside_r0(&mut w);
    w.release().unwrap(); // r0 goes to the writer, whose rename fails
    w.drain().expect("r0's failure is its own, not the capture's");
    File::open(d.path().join("r0.safetensors.lock")).unwrap().try_lock().expect("r0's client stops waiting");
    assert!(!d.path().join("r0.safetensors").is_file(), "and finds no file: an error for r0 alone");
    let r9 = File::open(d.path().join("r9.safetensors.lock")).unwrap();
    assert!(r9.try_lock().is_err(), "r9, still generating, keeps its lock: its file will come");
    let notes = w.take_notes();
    assert!(notes.iter().any(|n| n.contains("\"r0\"") && n.contains("fails alone")), "{notes:?}");
    step(&mut w, 1);
    w.drain().unwrap();
    assert!(d.path().join("r1.safetensors").is_file(), "the next request is served and written");
    assert_eq!(w.failed_requests(), 1);
    w.finish().expect("a server whose requests failed alone finishes cleanly");
}

#[test]
fn a_capture_wide_failure_gives_up_every_lock_the_server_holds() {
    // Before, only a completed write or an abort released a lock: after a failure of the capture (its assembler
    // thread, a device step, a store that takes nothing), every request's lock stayed held for as long as the process
    // lived, and its client waited on it. Now the first failure gives them up, on the thread that failed.
    let d = tempfile::tempdir().unwrap();
    let mut w = WorkerSession::new(cfg(true), staged(d.path(), 1 << 30)).unwrap();
    open_r9_beside_r0(&mut w);
    assert!(d.path().join("r9.safetensors.lock").exists());
    w.session().failure().report("the assembler thread failed earlier", crate::core_err!(Output, "a test's failure"));
    assert!(!d.path().join("r9.safetensors.lock").exists(), "r9's client finds no lock (an error), never a wait");
    assert!(w.release().is_err() && w.finish().is_err(), "the failure is the capture's");
}

#[test]
fn a_server_sweeps_what_no_client_collected_and_says_so() {
    let d = tempfile::tempdir().unwrap();
    let old = d.path().join("gone-client.safetensors");
    std::fs::write(&old, b"x").unwrap();
    let t = std::time::SystemTime::now() - crate::output::sinks::janitor::COLLECT_WITHIN - std::time::Duration::from_secs(1);
    std::fs::File::options().write(true).open(&old).unwrap().set_modified(t).unwrap();
    let o = staged(d.path(), 1 << 30);
    let mut w = WorkerSession::new(cfg(true), o).unwrap();
    step(&mut w, 0);
    assert!(!old.exists(), "an uncollected file older than the collection time is removed");
    let notes = w.take_notes();
    assert!(notes.len() == 1 && notes[0].contains("removed 1 files no client collected"), "{notes:?}");
    step(&mut w, 1);
    assert!(w.take_notes().is_empty(), "the next sweep waits for its interval");
    assert!(d.path().join("r1.safetensors").exists() || d.path().join("r1.safetensors.lock").exists());
    w.finish().unwrap();
}

/// A new request of a three-token prompt, generating at most `max_tokens`.
fn three_token_prompt(id: &str, max_tokens: Option<usize>) -> NewRequest {
    NewRequest { req_id: id.into(), prompt_token_ids: vec![1, 2, 3], num_computed_tokens: 0, sample: None, loss_mask: None, max_tokens }
}

#[test]
fn a_growing_sample_that_could_outgrow_its_bound_is_refused_at_admission_alone() {
    let d = tempfile::tempdir().unwrap();
    let mut o = staged(d.path(), 1 << 30);
    o.max_growing_sample = 10 * 8; // a row: 1 slot × 2 values × 4 bytes; at most 10 rows
    let mut w = WorkerSession::new(cfg(true), o).unwrap();
    let new = |id: &str, max_tokens| three_token_prompt(id, Some(max_tokens));
    // big: 3 prompt + 9 generated, all but the last through a forward = 11 rows > 10; fits: 3 + 8 - 1 = 10 rows.
    let input = StepInput {
        new_requests: vec![new("big", 9), new("fits", 8)],
        num_scheduled: vec![("big".into(), 3), ("fits".into(), 3)],
        total_tokens: 6,
        with_outputs: vec!["big".into(), "fits".into()],
        ..Default::default()
    };
    w.begin_step(input).unwrap();
    assert_eq!(w.plan(&["big".into(), "fits".into()], None).unwrap(), 3, "only the admitted request's rows are captured");
    let h = [0.5f32; 12];
    let t = TensorDesc { ptr: h.as_ptr() as usize, shape: vec![6, 2], strides: vec![2, 1], dtype: DType::F32, device: Device::Cpu };
    // SAFETY: `h` lives for the call and nobody writes it.
    unsafe { w.capture(0, None, &t, None, 0).unwrap() };
    w.end_step().unwrap();
    w.release().unwrap();
    let notes = w.take_notes().join("\n");
    assert!(notes.contains("\"big\" refused at admission") && notes.contains("11 rows"), "{notes}");
    assert!(!notes.contains("\"fits\""), "{notes}");
    assert_eq!(w.session().stats().refused, 1);
    let lock = |id: &str| crate::output::sinks::staging::lock_path(&d.path().join(crate::output::sinks::staging::file_name(id)));
    assert!(lock("fits").exists(), "the admitted request's file is promised (its lock)");
    assert!(!lock("big").exists(), "the refused one promises nothing: its client finds no file");
    w.finish().unwrap();
}

#[test]
fn generated_tokens_refused_here_refuse_every_growing_sample_and_keep_the_prompt_only_ones() {
    let d = tempfile::tempdir().unwrap();
    let mut o = staged(d.path(), 1 << 30);
    o.outputs_refused = Some("positions unknown here".into());
    let mut w = WorkerSession::new(cfg(true), o).unwrap();
    let new = three_token_prompt;
    // grows: with and without max_tokens both refused; prompt: its prompt only, admitted.
    let input = StepInput {
        new_requests: vec![new("grows", Some(4)), new("unbounded", None), new("prompt", Some(4))],
        num_scheduled: vec![("grows".into(), 3), ("unbounded".into(), 3), ("prompt".into(), 3)],
        total_tokens: 9,
        with_outputs: vec!["grows".into(), "unbounded".into()],
        ..Default::default()
    };
    w.begin_step(input).unwrap();
    let order = ["grows".into(), "unbounded".into(), "prompt".into()];
    assert_eq!(w.plan(&order, None).unwrap(), 3, "only the prompt-only request's rows are captured");
    let h: Vec<f32> = (0..18).map(|i| i as f32 * 0.25).collect(); // rows that differ: not degenerate states
    let t = TensorDesc { ptr: h.as_ptr() as usize, shape: vec![9, 2], strides: vec![2, 1], dtype: DType::F32, device: Device::Cpu };
    // SAFETY: `h` lives for the call and nobody writes it.
    unsafe { w.capture(0, None, &t, None, 0).unwrap() };
    w.end_step().unwrap();
    w.release().unwrap();
    let notes = w.take_notes().join("\n");
    for id in ["grows", "unbounded"] {
        assert!(notes.contains(&format!("\"{id}\" refused at admission: positions unknown here")), "{notes}");
    }
    assert_eq!(w.session().stats().refused, 2);
    let lock = |id: &str| crate::output::sinks::staging::lock_path(&d.path().join(crate::output::sinks::staging::file_name(id)));
    assert!(!lock("grows").exists() && !lock("unbounded").exists(), "the refused ones promise nothing");
    w.finish().unwrap();
    let file = |id: &str| d.path().join(crate::output::sinks::staging::file_name(id));
    assert!(file("prompt").exists(), "the prompt-only request's file is written");
    assert!(!file("grows").exists() && !file("unbounded").exists());
}
