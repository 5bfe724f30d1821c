//! Time the worker's thread spends in hscapture per step, inline assembly vs the assembler thread, side
//! by side in one run, with the forward stood in for by a sleep of the plain step time.
//!
//!     cargo run --release -p hscapture-worker --example assembly_bench -- OUT [STEPS] [FWD_MS] [REQS] [LEN]
//!
//! Each step: REQS new requests of LEN tokens (defaults 16 × 1024, the GPU benchmark's step), 4 layers of
//! width 4096 in bf16 (Llama-8B shape: 512 MiB of rows per step). Timed on the worker's thread:
//! `begin_step` + `plan` + `end_step` + `release` + handing completed samples to the writer (8 threads, page cache,
//! `OUT/<mode>`; in the background mode the assembler thread hands them over, as in the worker). Not timed: filling the step buffer (`capture`; on a GPU that is the kernel and the
//! asynchronous copy, off the host's thread). Between steps the thread sleeps FWD_MS (default 377 ms:
//! 16,384 tokens at the H200's plain 43,400 tok/s), during which the assembler and writer threads work.
//! Prints per-mode mean and worst worker time per step, the ratio it implies for end-to-end throughput
//! (fwd / (fwd + worker time)), and the time to drain at the end.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use hscapture_kernels::DType;
use hscapture_worker::attribution::layers::{Convention, LayerPlan};
use hscapture_worker::attribution::plan::{NewRequest, StepInput};
use hscapture_worker::capture::session::SessionConfig;
use hscapture_worker::capture::tensor::{Device, TensorDesc};
use hscapture_worker::worker::{Destination, Files, OutputSettings, WorkerSession};
use hscapture_worker::CoreResult;

const SLOTS: usize = 4;
const WIDTH: usize = 4096;

struct Figures {
    per_step: Vec<f64>,
    drain: f64,
}

fn run(out: PathBuf, background: bool, steps: usize, fwd: Duration, reqs: usize, len: usize) -> CoreResult<Figures> {
    let _ = std::fs::remove_dir_all(&out);
    let cfg = SessionConfig {
        layers: LayerPlan::new(&[2, 16, 28, 30], Convention::After, 32)?,
        hidden_size: WIDTH,
        model_dtype: DType::BF16,
        out_dtype: DType::BF16,
        assemble: true,
    };
    let settings = OutputSettings {
        destination: Destination::Directory(Files {
            root: out.clone(),
            format: "hscapture".into(),
            compress: None,
            durability: hscapture_worker::output::atomic::Durability::Rename,
        }),
        model: "bench".into(),
        layer_output: "sum".into(),
        threads: 8,
        queue: 64,
        max_growing_sample: u64::MAX,
        outputs_refused: None,
    };
    // The worker's own path: the session feeding the writer (from the assembler thread, in the background).
    let mut s = WorkerSession::new(cfg, settings)?;
    if background {
        s.set_background(2)?;
    }
    let total = reqs * len;
    // One step of bf16 activations (values irrelevant, finite): [total, WIDTH].
    let rows: Vec<u16> = (0..total * WIDTH).map(|i| 0x3f80 + (i % 64) as u16).collect();
    let desc = TensorDesc {
        ptr: rows.as_ptr() as usize,
        shape: vec![total, WIDTH],
        strides: vec![WIDTH as i64, 1],
        dtype: DType::BF16,
        device: Device::Cpu,
    };
    let mut per_step = Vec::with_capacity(steps);
    for step in 0..steps {
        let ids: Vec<String> = (0..reqs).map(|r| format!("s{step}r{r}")).collect();
        let input = StepInput {
            new_requests: ids
                .iter()
                .enumerate()
                .map(|(r, id)| NewRequest {
                    req_id: id.clone(),
                    prompt_token_ids: vec![1; len],
                    num_computed_tokens: 0,
                    sample: Some((step * reqs + r) as u64),
                    loss_mask: None,
                    max_tokens: None,
                })
                .collect(),
            num_scheduled: ids.iter().map(|id| (id.clone(), len)).collect(),
            total_tokens: total,
            ..Default::default()
        };
        let t = Instant::now();
        s.begin_step(input)?;
        s.plan(&ids, None)?;
        let mut worker = t.elapsed();
        for slot in 0..SLOTS {
            // SAFETY: `rows` is live and unchanged for the whole run.
            unsafe { s.capture(slot, None, &desc, None, 0)? };
        }
        let t = Instant::now();
        s.end_step()?;
        s.release()?; // as the worker does once its ranks' meeting passed (one rank here)
        worker += t.elapsed();
        per_step.push(worker.as_secs_f64());
        std::thread::sleep(fwd);
    }
    let t = Instant::now();
    let mut recs = s.drain()?;
    recs.extend(s.finish()?);
    let drain = t.elapsed().as_secs_f64();
    assert_eq!(recs.len(), steps * reqs, "every sample written");
    let _ = std::fs::remove_dir_all(&out);
    Ok(Figures { per_step, drain })
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(out) = args.first().map(PathBuf::from) else {
        eprintln!("usage: assembly_bench OUT [STEPS=12] [FWD_MS=377] [REQS=16] [LEN=1024]");
        std::process::exit(2);
    };
    let num = |i: usize, d: usize| args.get(i).and_then(|x| x.parse().ok()).unwrap_or(d);
    let (steps, fwd_ms, reqs, len) = (num(1, 12), num(2, 377), num(3, 16), num(4, 1024));
    let fwd = Duration::from_millis(fwd_ms as u64);
    println!(
        "{steps} steps of {reqs} × {len} tokens, {SLOTS} layers × {WIDTH} bf16 ({:.0} MiB of rows per step); forward stand-in {fwd_ms} ms",
        (reqs * len * SLOTS * WIDTH * 2) as f64 / 1048576.0
    );
    // Alternating twice so both modes see the same machine state; the first step of each run is warm-up.
    let mut best: HashMap<&str, (f64, f64, f64)> = HashMap::new();
    for round in 0..2 {
        for (name, bg) in [("inline", false), ("background", true)] {
            match run(out.join(name), bg, steps, fwd, reqs, len) {
                Ok(f) => {
                    let tail = &f.per_step[1..];
                    let mean = tail.iter().sum::<f64>() / tail.len() as f64;
                    let worst = tail.iter().cloned().fold(0.0, f64::max);
                    println!(
                        "round {round} {name:>10}: worker {:.1} ms/step (worst {:.1}); drain {:.2} s",
                        mean * 1e3,
                        worst * 1e3,
                        f.drain
                    );
                    let e = best.entry(name).or_insert((f64::MAX, 0.0, 0.0));
                    if mean < e.0 {
                        *e = (mean, worst, f.drain);
                    }
                }
                Err(e) => {
                    eprintln!("{name}: {e}");
                    std::process::exit(1);
                }
            }
        }
    }
    let f = fwd.as_secs_f64();
    for name in ["inline", "background"] {
        if let Some((mean, worst, drain)) = best.get(name) {
            println!(
                "{name:>10}: {:.1} ms/step on the worker's thread (worst {:.1}) -> {:.3}x of plain prefill at {fwd_ms} ms/step; drain {:.2} s",
                mean * 1e3,
                worst * 1e3,
                f / (f + mean),
                drain
            );
        }
    }
}
