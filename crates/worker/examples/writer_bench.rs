//! Durable writing against the disk's own bandwidth, side by side in one run.
//!
//!     cargo run --release -p hscapture-worker --example writer_bench -- DIR [SAMPLES] [TOKENS] [THREADS]
//!
//! Measures, on the file system holding DIR, alternately: the ceiling (one file of the same total size
//! written sequentially in 16 MiB blocks, then `fdatasync`) and hscapture's writer with `durable` on
//! (each sample to a hidden temporary file, fsync, rename, directory fsync, journal line synced), for
//! each thread count, and the ceiling once more at the end. Samples are Llama-8B shaped by default:
//! TOKENS × 4 layers × 4096 bf16 (32 MiB per 1024-token sample), incompressible bytes. Prints each
//! figure and each writer's ratio to the best ceiling seen (the conservative reference: disks vary).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use hscapture_kernels::DType;
use hscapture_worker::failure::Failure;
use hscapture_worker::output::formats::by_name;
use hscapture_worker::output::ledger::record::Identity;
use hscapture_worker::output::sinks::sink::FileSink;
use hscapture_worker::output::sinks::writer::{Writer, WriterConfig};
use hscapture_worker::sample::Sample;
use hscapture_worker::sample::SampleKey;

const SLOTS: usize = 4;
const WIDTH: usize = 4096;

fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(n);
    v
}

fn ceiling(dir: &Path, bytes: usize) -> std::io::Result<f64> {
    let path = dir.join("ceiling.bin");
    let block = noise(16 << 20, 7);
    let t = Instant::now();
    let mut f = std::fs::File::create(&path)?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(block.len());
        f.write_all(&block[..n])?;
        left -= n;
    }
    f.sync_data()?;
    let s = t.elapsed().as_secs_f64();
    drop(f);
    std::fs::remove_file(&path)?;
    Ok(bytes as f64 / s / 1e9)
}

fn run_writer(root: &Path, threads: usize, samples: Vec<Sample>) -> Result<f64, String> {
    let bytes: usize = samples.iter().map(|s| s.data.len()).sum();
    let _ = std::fs::remove_dir_all(root);
    let identity = Identity {
        format: "hscapture".into(),
        model: "writer_bench".into(),
        layer_ids: (0..SLOTS).collect(),
        convention: "after".into(),
        dtype: "bfloat16".into(),
        hidden_size: WIDTH,
        num_hidden_layers: SLOTS,
        layer_output: Identity::summed(),
    };
    let t = Instant::now();
    let format = by_name("hscapture", None).map_err(|e| e.to_string())?;
    let sink = std::sync::Arc::new(
        FileSink::open(root, format, identity, hscapture_worker::output::atomic::Durability::Fsync).map_err(|e| e.to_string())?,
    );
    let cfg = WriterConfig { threads, queue: 2 * threads, pool: None, keep_records: true };
    let mut w = Writer::start(sink, cfg, Failure::new()).map_err(|e| e.to_string())?;
    for s in samples {
        w.submit(s).map_err(|e| e.to_string())?;
    }
    let recs = w.finish().map_err(|e| e.to_string())?;
    let s = t.elapsed().as_secs_f64();
    let written: u64 = recs.iter().map(|r| r.bytes).sum();
    let _ = std::fs::remove_dir_all(root);
    Ok(written.max(bytes as u64) as f64 / s / 1e9)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(dir) = args.first().map(PathBuf::from) else {
        eprintln!("usage: writer_bench DIR [SAMPLES=32] [TOKENS=1024] [THREADS=1,2,4,8]");
        std::process::exit(2);
    };
    let n: usize = args.get(1).and_then(|x| x.parse().ok()).unwrap_or(32);
    let tokens: usize = args.get(2).and_then(|x| x.parse().ok()).unwrap_or(1024);
    let threads: Vec<usize> = args.get(3).map_or("1,2,4,8", |x| x.as_str()).split(',').filter_map(|x| x.parse().ok()).collect();
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("cannot create {}: {e}", dir.display());
        std::process::exit(2);
    }
    let per = tokens * SLOTS * WIDTH * 2;
    let template = noise(per, 11);
    let total = n * per;
    println!(
        "{n} samples of {tokens} tokens × {SLOTS} layers × {WIDTH} bf16 ({:.0} MiB each, {:.2} GiB in all)",
        per as f64 / 1048576.0,
        total as f64 / 1073741824.0
    );
    let measure = |ceilings: &mut Vec<f64>| match ceiling(&dir, total) {
        Ok(c) => {
            println!("ceiling: {c:.3} GB/s (one file, sequential, fdatasync)");
            ceilings.push(c);
        }
        Err(e) => {
            eprintln!("ceiling: {e}");
            std::process::exit(1);
        }
    };
    let mut ceilings = Vec::new();
    let mut results = Vec::new();
    for &t in &threads {
        measure(&mut ceilings);
        let samples: Vec<Sample> = (0..n)
            .map(|i| Sample {
                key: SampleKey::Index(i as u64),
                req_id: format!("r{i}"),
                token_ids: (0..tokens as i64).collect(),
                data: template.clone(),
                rows: tokens,
                slots: SLOTS,
                width: WIDTH,
                dtype: DType::BF16,
                loss_mask: None,
                scales: None,
            })
            .collect();
        match run_writer(&dir.join(format!("w{t}")), t, samples) {
            Ok(g) => {
                println!("writer, durable, {t} threads: {g:.3} GB/s");
                results.push((t, g));
            }
            Err(e) => {
                eprintln!("writer with {t} threads: {e}");
                std::process::exit(1);
            }
        }
    }
    measure(&mut ceilings);
    let c = ceilings.iter().cloned().fold(0.0, f64::max);
    println!("best ceiling {c:.3} GB/s (of {})", ceilings.iter().map(|x| format!("{x:.3}")).collect::<Vec<_>>().join(", "));
    for (t, g) in results {
        println!("writer, durable, {t} threads: {g:.3} GB/s = {:.3}x the best ceiling", g / c);
    }
}
