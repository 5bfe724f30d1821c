//! The `legacy` format: the layout speculators 0.3/0.4's offline generator wrote and their trainers
//! read — `OUT/data_{i}.pt`, a torch archive (`torch.save`) of
//! `{"input_ids": int64 [L], "hidden_states": [per-layer [L, H]], "loss_mask": int64 [L]}`, layers in
//! ascending id order.
//!
//! Written here directly (no torch in the worker): the pickle is the one `torch.save` writes for that
//! dictionary, minus its memo (protocol 2: `_rebuild_tensor_v2` over persistent storage ids, every
//! opcode one `torch.load(weights_only=True)` accepts), and the storages are stored entries of the
//! zip container (`zip.rs`). The reader accepts exactly what this writer writes: it rebuilds the
//! pickle the sample's shape implies and requires the archive's to be byte-equal.

use std::borrow::Cow;

use crate::output::formats::zip::{self, Entry};
use crate::output::formats::Format;
use crate::output::ledger::record::Identity;
use crate::sample::SampleKey;
use crate::sample::{LoadedSample, Sample};
use crate::{bail, core_err, ensure, error::CoreResult};
use hscapture_kernels::DType;

/// The archive's top-level folder (torch accepts any single one).
const ROOT: &str = "archive";

pub struct Legacy;

fn storage_type(d: DType) -> &'static str {
    match d {
        DType::F32 => "FloatStorage",
        DType::BF16 => "BFloat16Storage",
        DType::F16 => "HalfStorage",
    }
}

/// A protocol-2 pickle, the opcodes torch's archives use.
struct Pickle(Vec<u8>);

impl Pickle {
    fn op(&mut self, b: u8) {
        self.0.push(b);
    }
    fn global(&mut self, module: &str, name: &str) {
        self.op(b'c');
        self.0.extend_from_slice(format!("{module}\n{name}\n").as_bytes());
    }
    fn text(&mut self, s: &str) {
        self.op(b'X');
        self.0.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.0.extend_from_slice(s.as_bytes());
    }
    fn int(&mut self, v: u64) {
        if v < 0x100 {
            self.op(b'K');
            self.op(v as u8);
        } else if v < 0x1_0000 {
            self.op(b'M');
            self.0.extend_from_slice(&(v as u16).to_le_bytes());
        } else if v < 0x8000_0000 {
            self.op(b'J');
            self.0.extend_from_slice(&(v as u32).to_le_bytes());
        } else {
            // LONG1: little-endian two's complement, with a zero byte if the top bit is set.
            let mut b = v.to_le_bytes().to_vec();
            while b.len() > 1 && b[b.len() - 1] == 0 && b[b.len() - 2] & 0x80 == 0 {
                b.pop();
            }
            if b[b.len() - 1] & 0x80 != 0 {
                b.push(0);
            }
            self.op(0x8a);
            self.op(b.len() as u8);
            self.0.extend_from_slice(&b);
        }
    }
    fn tuple(&mut self, items: &[u64]) {
        match items.len() {
            1 => {
                self.int(items[0]);
                self.op(0x85);
            }
            2 => {
                self.int(items[0]);
                self.int(items[1]);
                self.op(0x86);
            }
            _ => {
                self.op(b'(');
                items.iter().for_each(|&i| self.int(i));
                self.op(b't');
            }
        }
    }
    /// `torch._utils._rebuild_tensor_v2(storage key, 0, shape, contiguous stride, False, OrderedDict())`.
    fn tensor(&mut self, storage: &str, key: usize, shape: &[u64]) {
        let numel: u64 = shape.iter().product();
        self.global("torch._utils", "_rebuild_tensor_v2");
        self.op(b'(');
        self.op(b'(');
        self.text("storage");
        self.global("torch", storage);
        self.text(&key.to_string());
        self.text("cpu");
        self.int(numel);
        self.op(b't');
        self.op(b'Q');
        self.int(0);
        self.tuple(shape);
        let stride: Vec<u64> = (0..shape.len()).map(|d| shape[d + 1..].iter().product()).collect();
        self.tuple(&stride);
        self.op(0x89);
        self.global("collections", "OrderedDict");
        self.op(b')');
        self.op(b'R');
        self.op(b't');
        self.op(b'R');
    }
}

/// The pickle of a sample of `rows` tokens, `slots` layers of `width` in `dtype`.
fn pickle(rows: u64, slots: usize, width: u64, dtype: DType) -> Vec<u8> {
    let mut p = Pickle(Vec::with_capacity(256 + 120 * slots));
    p.op(0x80);
    p.op(2);
    p.op(b'}');
    p.op(b'(');
    p.text("input_ids");
    p.tensor("LongStorage", 0, &[rows]);
    p.text("hidden_states");
    p.op(b']');
    p.op(b'(');
    for k in 0..slots {
        p.tensor(storage_type(dtype), k + 1, &[rows, width]);
    }
    p.op(b'e');
    p.text("loss_mask");
    p.tensor("LongStorage", slots + 1, &[rows]);
    p.op(b'u');
    p.op(b'.');
    p.0
}

fn name(rest: &str) -> String {
    format!("{ROOT}/{rest}")
}

fn longs(v: impl Iterator<Item = i64>) -> Vec<u8> {
    v.flat_map(i64::to_le_bytes).collect()
}

impl Legacy {
    /// The archive's entries for `sample`, with zip64 forced (tests).
    pub(crate) fn archive<'a>(&self, sample: &'a Sample, force_zip64: bool) -> CoreResult<Vec<Cow<'a, [u8]>>> {
        crate::output::formats::sample_file::check_sample(sample)?;
        let [rows, slots, width] = sample.shape();
        let mask = match &sample.loss_mask {
            Some(m) => {
                ensure!(m.len() == rows, ShapeContract, "{}: a loss mask of {} values for {rows} tokens", sample.key, m.len());
                longs(m.iter().map(|&x| i64::from(x)))
            }
            None => longs(std::iter::repeat_n(1, rows)),
        };
        let mut entries = vec![
            Entry { name: name("data.pkl"), parts: vec![Cow::Owned(pickle(rows as u64, slots, width as u64, sample.dtype))] },
            Entry { name: name(".format_version"), parts: vec![Cow::Borrowed(b"1")] },
            Entry { name: name(".storage_alignment"), parts: vec![Cow::Borrowed(b"64")] },
            Entry { name: name("byteorder"), parts: vec![Cow::Borrowed(b"little")] },
            Entry { name: name("data/0"), parts: vec![Cow::Owned(longs(sample.token_ids.iter().copied()))] },
        ];
        for k in 0..slots {
            // Layer k's rows, gathered from the [L, n, H] sample without a copy.
            let parts = (0..rows).map(|pos| Cow::Borrowed(sample.cell(pos, k))).collect();
            entries.push(Entry { name: name(&format!("data/{}", k + 1)), parts });
        }
        entries.push(Entry { name: name(&format!("data/{}", slots + 1)), parts: vec![Cow::Owned(mask)] });
        entries.push(Entry { name: name("version"), parts: vec![Cow::Borrowed(b"3\n")] });
        Ok(zip::archive(entries, force_zip64))
    }
}

fn longs_of(b: &[u8], what: &str, entry: &str) -> CoreResult<Vec<i64>> {
    ensure!(b.len().is_multiple_of(8), Output, "{what}: {entry} holds {} bytes, not whole int64 values", b.len());
    Ok(b.chunks_exact(8).map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])).collect())
}

impl Format for Legacy {
    fn name(&self) -> &'static str {
        "legacy"
    }

    fn file(&self, key: &SampleKey) -> String {
        match key {
            SampleKey::Index(i) => format!("data_{i}.pt"),
            SampleKey::Request(_) => format!("{}.pt", crate::sample::file_stem(key)),
        }
    }

    fn folder(&self) -> &'static str {
        ""
    }

    fn file_pattern(&self) -> &'static str {
        "data_{i}.pt"
    }

    fn index_of(&self, name: &str) -> Option<u64> {
        name.strip_prefix("data_")?.strip_suffix(".pt")?.parse().ok()
    }

    fn encode<'a>(&self, sample: &'a Sample, _identity: &Identity) -> CoreResult<Vec<Cow<'a, [u8]>>> {
        crate::output::formats::sample_file::refuse_quantized(sample, "legacy")?;
        self.archive(sample, false)
    }

    fn decode(&self, bytes: &[u8], what: &str) -> CoreResult<LoadedSample> {
        let entries = zip::entries(bytes, what)?;
        let get = |rest: &str| entries.iter().find(|(n, _)| *n == name(rest)).map(|(_, d)| *d);
        let Some(pkl) = get("data.pkl") else {
            bail!(Output, "{what}: no {ROOT}/data.pkl: not written by hscapture (another tool's torch archive?)");
        };
        let storages = entries.iter().filter(|(n, _)| n.starts_with(&name("data/"))).count();
        ensure!(storages >= 3, Output, "{what}: {storages} storages; expected input_ids, at least one layer and loss_mask");
        let slots = storages - 2;
        let entry = |k: usize| get(&format!("data/{k}")).ok_or_else(|| core_err!(Output, "{what}: storage data/{k} is missing"));
        let token_ids = longs_of(entry(0)?, what, "input_ids")?;
        let rows = token_ids.len();
        let dtype = [DType::F32, DType::BF16, DType::F16]
            .into_iter()
            .find(|&d| pkl.windows(storage_type(d).len()).any(|w| w == storage_type(d).as_bytes()))
            .ok_or_else(|| core_err!(Output, "{what}: the pickle names no float storage hscapture writes"))?;
        let layer_bytes = entry(1)?.len();
        let es = dtype.size();
        ensure!(rows > 0 && layer_bytes % (rows * es) == 0, Output, "{what}: a layer of {layer_bytes} bytes for {rows} tokens of {dtype}");
        let width = layer_bytes / (rows * es);
        ensure!(
            pkl == pickle(rows as u64, slots, width as u64, dtype).as_slice(),
            Output,
            "{what}: its pickle is not the one hscapture writes for [{rows}, {slots}, {width}] {dtype}: the file was \
             changed, or not written by hscapture"
        );
        let rb = width * es;
        let total = rows
            .checked_mul(slots)
            .and_then(|x| x.checked_mul(rb))
            .ok_or_else(|| core_err!(Output, "{what}: the sample's size overflows"))?;
        let mut data = Vec::new();
        data.try_reserve_exact(total).map_err(|_| core_err!(Output, "{what}: cannot hold {total} bytes of states in memory"))?;
        data.resize(total, 0);
        for k in 0..slots {
            let layer = entry(k + 1)?;
            ensure!(layer.len() == rows * rb, Output, "{what}: layer slot {k} holds {} bytes, expected {}", layer.len(), rows * rb);
            for pos in 0..rows {
                let o = (pos * slots + k) * rb;
                data[o..o + rb].copy_from_slice(&layer[pos * rb..(pos + 1) * rb]);
            }
        }
        let mask = longs_of(entry(slots + 1)?, what, "loss_mask")?;
        ensure!(
            mask.len() == rows && mask.iter().all(|&m| m == 0 || m == 1),
            Output,
            "{what}: loss_mask should be {rows} values of 0 or 1, found {} values",
            mask.len()
        );
        let mut s = LoadedSample::new(token_ids, [rows, slots, width], dtype, data, Default::default());
        s.loss_mask = Some(mask.into_iter().map(|m| m as u8).collect());
        Ok(s)
    }
}

#[cfg(test)]
#[path = "tests/legacy.rs"]
mod tests;
