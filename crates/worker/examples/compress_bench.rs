//! Compression ratio and speed of byte-plane + zstd on captured states, against plain zstd, per level.
//!
//!     cargo run --release -p hscapture-worker --example compress_bench -- OUT/hidden_states [LEVELS]
//!
//! Reads every `*.safetensors` sample in the directory (compressed or not), then for each level prints
//! the stored/raw ratio and single-thread encode and decode throughput (MB/s of raw states).

use std::time::Instant;

use hscapture_worker::output::formats::compress::{decode, encode};
use hscapture_worker::output::formats::read_sample_file;

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(dir) = args.next() else {
        eprintln!("usage: compress_bench DIR [LEVELS, e.g. 1,3,9]");
        std::process::exit(2);
    };
    let levels: Vec<i32> = args.next().unwrap_or_else(|| "1,3,9".into()).split(',').filter_map(|x| x.parse().ok()).collect();
    let mut samples = Vec::new();
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("cannot read {dir}: {e}");
            std::process::exit(2);
        }
    };
    for e in entries.flatten() {
        if e.path().extension().is_some_and(|x| x == "safetensors") {
            match read_sample_file(&e.path()) {
                Ok(s) => samples.push(s),
                Err(err) => eprintln!("skipping {}: {err}", e.path().display()),
            }
        }
    }
    let raw: usize = samples.iter().map(|s| s.data.len()).sum();
    let dtype = samples.first().map(|s| format!("{}", s.dtype)).unwrap_or_default();
    println!("{} samples, {:.1} MiB of {dtype} states", samples.len(), raw as f64 / 1048576.0);
    for level in levels {
        let t = Instant::now();
        let packed: Vec<Vec<u8>> = samples.iter().filter_map(|s| encode(&s.data, s.dtype.size(), level).ok()).collect();
        let enc = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let ok = samples.iter().zip(&packed).all(|(s, p)| decode(p, s.dtype.size(), s.data.len(), "bench").is_ok_and(|d| d == s.data));
        let dec = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let plain: usize = samples.iter().filter_map(|s| zstd::bulk::compress(&s.data, level).ok()).map(|v| v.len()).sum();
        let plain_s = t.elapsed().as_secs_f64();
        let stored: usize = packed.iter().map(Vec::len).sum();
        println!(
            "level {level}: byte-plane+zstd {:.3} of raw, encode {:.0} MB/s, decode {:.0} MB/s, lossless {ok}; plain zstd {:.3} of raw ({:.0} MB/s)",
            stored as f64 / raw as f64,
            raw as f64 / enc / 1e6,
            raw as f64 / dec / 1e6,
            plain as f64 / raw as f64,
            raw as f64 / plain_s / 1e6
        );
    }
}
