//! A device stand-in for the session's tests (`DeviceBackend` in host memory).

use super::tests::H;
use crate::capture::arena::Arena;
use crate::capture::tensor::{Device, TensorDesc};
use crate::error::CoreResult;
use hscapture_kernels::{capture_rows, DType};

/// A device stand-in in host memory: "device" tensors are host memory tagged cuda, the kernel is the
/// CPU twin, and the copy to the step's host buffer happens at `end_step` (so data is only visible
/// after `wait`, as with a real device). Host buffers round a ring like the real one's.
pub(crate) struct HostDevice {
    slots: usize,
    cap: usize,
    runs: Vec<hscapture_kernels::RowRun>,
    rows: usize,
    dev: Arena,
    /// The ring: None while a buffer is handed out.
    hosts: Vec<Option<Arena>>,
    cur: Option<usize>,
    /// Buffers of ended steps not yet collected, oldest first (their copies ran at `end_step`: the
    /// stand-in models a device whose next step waits for them, as the CUDA path's stream wait does).
    flight: std::collections::VecDeque<usize>,
    pub(crate) waits: usize,
    /// fp8: the twin quantizes each step at `end_step`; per ring buffer, its codes (`[slot][cap][H]`) and scales.
    quantize: bool,
    codes: Vec<Option<(Vec<u8>, Vec<f32>)>>,
}

impl HostDevice {
    pub(crate) fn new(slots: usize, cap: usize, ring: usize) -> HostDevice {
        HostDevice {
            slots,
            cap,
            runs: vec![],
            rows: 0,
            dev: Arena::new(slots, H, DType::F32),
            hosts: (0..ring).map(|_| Some(Arena::new(slots, H, DType::F32))).collect(),
            cur: None,
            flight: std::collections::VecDeque::new(),
            waits: 0,
            quantize: false,
            codes: (0..ring).map(|_| None).collect(),
        }
    }

    /// As `new`, quantizing each step to fp8 as the CUDA path does (the twin over the step's arena).
    pub(crate) fn quantizing(slots: usize, cap: usize, ring: usize) -> HostDevice {
        HostDevice { quantize: true, ..HostDevice::new(slots, cap, ring) }
    }
}

struct HostBuf {
    slot: usize,
    arena: Arena,
    cap: usize,
    codes: Option<(Vec<u8>, Vec<f32>)>,
}

impl crate::capture::rows::StepRows for HostBuf {
    fn row(&self, slot: usize, row: usize) -> &[u8] {
        match &self.codes {
            Some((c, _)) => &c[(slot * self.cap + row) * H..(slot * self.cap + row + 1) * H],
            None => self.arena.row(slot, row),
        }
    }
    fn scale(&self, row: usize) -> Option<f32> {
        self.codes.as_ref().map(|(_, s)| s[row])
    }
    fn nonfinite(&self, slot: usize, row: usize) -> u32 {
        self.arena.nonfinite(slot, row)
    }
    fn row_sum(&self, slot: usize, row: usize) -> u64 {
        self.arena.row_sum(slot, row)
    }
}

impl crate::capture::device::PinnedStep for HostBuf {
    fn ring_slot(&self) -> usize {
        self.slot
    }
    fn rows(&self) -> CoreResult<Box<dyn crate::capture::rows::StepRows + Sync + '_>> {
        Ok(Box::new(self))
    }
}

impl crate::capture::device::DeviceBackend for HostDevice {
    fn capacity(&self) -> usize {
        self.cap
    }
    fn allocated(&self) -> (usize, usize) {
        (self.dev.allocated_bytes(), self.hosts.iter().flatten().map(Arena::allocated_bytes).sum())
    }
    fn free_host(&self) -> usize {
        self.hosts.iter().enumerate().filter(|(i, h)| h.is_some() && !self.flight.contains(i)).count()
    }
    fn ring(&self) -> usize {
        self.hosts.len()
    }
    fn quantizes(&self) -> bool {
        self.quantize
    }
    fn reset(&mut self, rows: usize, runs: &[hscapture_kernels::RowRun]) -> CoreResult<()> {
        if self.cur.is_none() {
            let free = (0..self.hosts.len()).find(|i| self.hosts[*i].is_some() && !self.flight.contains(i));
            let Some(i) = free else {
                crate::bail!(Compatibility, "no free host buffer");
            };
            self.cur = Some(i);
        }
        self.rows = rows;
        self.runs = runs.to_vec();
        self.dev.reset(rows);
        Ok(())
    }
    unsafe fn capture(&mut self, slot: usize, hidden: &TensorDesc, residual: Option<&TensorDesc>, _stream: u64) -> CoreResult<()> {
        let as_cpu = |d: &TensorDesc| TensorDesc { device: Device::Cpu, ..d.clone() };
        let rows = hidden.rows();
        // SAFETY: the test's "device" tensors are live host memory.
        let h = unsafe { as_cpu(hidden).cpu_rows("h", rows)? };
        // SAFETY: as above.
        let r = match residual {
            Some(r) => Some(unsafe { as_cpu(r).cpu_rows("r", rows)? }),
            None => None,
        };
        let mut t = self.dev.target(slot, "x")?;
        capture_rows(&h, r.as_ref(), &self.runs, &mut t).map_err(|e| crate::core_err!(ShapeContract, "{e}"))
    }
    fn end_step(&mut self) -> CoreResult<()> {
        let i = self.cur.expect("end_step without reset");
        let mut host = self.hosts[i].take().expect("the step's host buffer is free");
        host.reset(self.rows);
        for s in 0..self.slots {
            let src = self.dev.target(s, "x")?;
            let (d, sums, bad) = (src.data.to_vec(), src.row_sums.to_vec(), src.nonfinite.to_vec());
            let dst = host.target(s, "x")?;
            dst.data.copy_from_slice(&d);
            dst.row_sums.copy_from_slice(&sums);
            dst.nonfinite.copy_from_slice(&bad);
        }
        if self.quantize {
            // Gather each row's slots (the arena is slot-major), quantize, scatter the codes back slot-major.
            let (n, slots, w) = (self.rows, self.slots, H);
            let mut rows = vec![0u8; n * slots * w * 4];
            for r in 0..n {
                for s in 0..slots {
                    rows[(r * slots + s) * w * 4..(r * slots + s + 1) * w * 4]
                        .copy_from_slice(crate::capture::rows::StepRows::row(&host, s, r));
                }
            }
            let (mut q, mut scales) = (vec![0u8; n * slots * w], vec![0f32; n]);
            hscapture_kernels::fp8::quantize(&rows, DType::F32, n, slots * w, &mut q, &mut scales);
            let mut codes = vec![0u8; slots * self.cap * w];
            for r in 0..n {
                for s in 0..slots {
                    let at = (s * self.cap + r) * w;
                    codes[at..at + w].copy_from_slice(&q[(r * slots + s) * w..(r * slots + s + 1) * w]);
                }
            }
            self.codes[i] = Some((codes, scales));
        }
        self.hosts[i] = Some(host);
        self.cur = None;
        self.flight.push_back(i);
        Ok(())
    }
    fn wait(&mut self) -> CoreResult<Box<dyn crate::capture::device::PinnedStep>> {
        self.waits += 1;
        let i = self.flight.pop_front().expect("wait without a step in flight");
        let arena = self.hosts[i].take().expect("the buffer is not handed out twice");
        Ok(Box::new(HostBuf { slot: i, arena, cap: self.cap, codes: self.codes[i].take() }))
    }
    fn recycle(&mut self, buf: Box<dyn crate::capture::device::PinnedStep>) -> CoreResult<()> {
        let i = buf.ring_slot();
        assert!(self.hosts[i].is_none(), "buffer {i} given back twice");
        // The stand-in cannot downcast the box; a fresh arena of the same shape stands for it.
        self.hosts[i] = Some(Arena::new(self.slots, H, DType::F32));
        Ok(())
    }
}
