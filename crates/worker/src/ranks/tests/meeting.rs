use super::*;

#[test]
fn ranks_on_one_path_agree_and_others_are_refused_by_name() {
    let dev = path_code("device", 1).unwrap();
    assert_eq!(agree_on_paths(&[dev, dev, dev]).unwrap(), None);
    assert_eq!(agree_on_paths(&[path_code("none", 1).unwrap(); 2]).unwrap(), None); // overlap means nothing there
    let e = agree_on_paths(&[dev, path_code("host", 0).unwrap()]).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Compatibility);
    assert!(e.message.contains("rank 0: device (1 steps in flight); rank 1: host"), "{}", e.message);
    let e = agree_on_paths(&[dev, path_code("device", 0).unwrap()]).unwrap_err();
    assert!(e.message.contains("rank 1: device)"), "{}", e.message);
    let failed = path_code("failed", 0).unwrap();
    assert_eq!(agree_on_paths(&[dev, failed, failed]).unwrap().as_deref(), Some("tensor-parallel rank(s) [1, 2]"));
    assert!(path_code("gpu", 0).is_err());
}

#[test]
fn a_meeting_agrees_only_on_the_same_steps_with_the_same_checksums() {
    let steps = [(3, 0xabc), (4, u64::MAX)];
    let a = record(false, &steps, 0).to_vec();
    let b = record(false, &steps, 8).to_vec();
    assert_eq!(decide("end", &[a.clone(), b.clone()]).unwrap(), Verdict::Agreed);
    // The digest is FNV-1a over (step, checksum) as Python computed it before: order and values count.
    assert_ne!(digest(&steps), digest(&[(4, u64::MAX), (3, 0xabc)]));
    assert_eq!(digest(&[]), 0xcbf2_9ce4_8422_2325_u64 as i64);
    let other = record(false, &[(3, 0xabc), (4, 1)], 8).to_vec();
    assert_eq!(decide("end", &[a.clone(), other]).unwrap(), Verdict::CompareSteps);
    let fewer = record(false, &steps[..1], 8).to_vec();
    let e = decide("end", &[a.clone(), fewer]).unwrap_err();
    assert!(e.kind == ErrorKind::RankMismatch && e.message.contains("per rank [2, 1]"), "{}", e.message);
    let failed = record(true, &[], 9).to_vec();
    assert_eq!(decide("end", &[a, b, failed]).unwrap(), Verdict::PeersFailed("tensor-parallel rank 2 (global rank 9)".into()));
    assert!(decide("end", &[vec![0, 0, 0]]).is_err());
}

#[test]
fn comparing_steps_names_the_first_that_differs_or_calls_it_a_bug() {
    let e = compare_steps("tensor-parallel", &[(3, vec![1, 1]), (4, vec![5, 6])]);
    assert!(e.kind == ErrorKind::RankMismatch && e.message.starts_with("step 4:"), "{}", e.message);
    let e = compare_steps("end", &[(3, vec![1, 1])]);
    assert!(e.message.contains("no single step's checksum did"), "{}", e.message);
}
