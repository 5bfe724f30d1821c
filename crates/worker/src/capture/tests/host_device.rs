//! A device stand-in for the session's tests (`DeviceBackend` in host memory): the armed protocol of the CUDA path
//! with the kernels' CPU twins.

use super::tests::H;
use crate::capture::device::{DeviceBackend, PinnedStep};
use crate::capture::host_pool::HostPool;
use crate::capture::rows::StepRows;
use crate::capture::tensor::{Device, TensorDesc};
use crate::error::CoreResult;
use hscapture_kernels::armed::{ArmedLayout, ArmedTarget, Control, STAMP_WORDS};
use hscapture_kernels::{capture_armed, DType, RowRun, Stamp};

/// A device stand-in in host memory: "device" tensors are host memory tagged cuda, the launch is the armed kernel's
/// CPU twin (reading the control block and the source rows the way a replayed CUDA graph would), and the copy to the
/// step's host buffer happens at `end_step` (so data is only visible after `wait`, as with a real device). The
/// arena has halves and host buffers round a ring like the real ones.
pub(crate) struct HostDevice {
    layout: ArmedLayout,
    ctl: Control,
    src: Vec<i32>,
    data: Vec<u8>,
    sums: Vec<u64>,
    bad: Vec<u32>,
    stamps: Vec<u32>,
    next_half: usize,
    armed: Option<(usize, usize)>,
    /// The ring: None while a buffer is handed out.
    hosts: Vec<Option<HostBuf>>,
    /// Which buffer is where, by size (as the CUDA ring's).
    pool: HostPool,
    pub(crate) waits: usize,
    /// Launches so far, armed or not.
    pub(crate) launches: usize,
    /// fp8: the twin quantizes each step at `end_step` (codes `[slot][cap][H]` and scales in its host buffer).
    quantize: bool,
}

impl HostDevice {
    pub(crate) fn new(slots: usize, cap: usize, ring: usize) -> HostDevice {
        HostDevice::with_small(slots, cap, ring, 0)
    }

    /// As `new`, with `ring` more host buffers of `small` rows (as the CUDA path's `small_rows`).
    pub(crate) fn with_small(slots: usize, cap: usize, ring: usize, small: usize) -> HostDevice {
        let pool = HostPool::new(&[(ring, cap), (if small < cap { ring } else { 0 }, small)]).expect("a ring");
        let layout = ArmedLayout { slots, capacity: cap, width: H, halves: 2 };
        let rows = layout.stat_row(2, 0, 0);
        HostDevice {
            layout,
            ctl: Control::DISARMED,
            src: vec![0; cap],
            data: vec![0; rows * H * 4],
            sums: vec![0; rows],
            bad: vec![0; rows],
            stamps: vec![0; layout.stamp_at(2, 0)],
            next_half: 0,
            armed: None,
            hosts: (0..pool.len()).map(|i| Some(HostBuf::empty(i))).collect(),
            pool,
            waits: 0,
            launches: 0,
            quantize: false,
        }
    }

    /// As `new`, quantizing each step to fp8 as the CUDA path does (the twin over the step's rows).
    pub(crate) fn quantizing(slots: usize, cap: usize, ring: usize) -> HostDevice {
        HostDevice { quantize: true, ..HostDevice::new(slots, cap, ring) }
    }
}

#[derive(Default)]
struct HostBuf {
    slot: usize,
    cap: usize,
    /// `[slot][row]` rows (f32 here), checksums, counts; stamps; fp8 codes and scales.
    data: Vec<Vec<u8>>,
    sums: Vec<Vec<u64>>,
    bad: Vec<Vec<u32>>,
    stamps: Vec<u32>,
    codes: Option<(Vec<u8>, Vec<f32>)>,
}

impl HostBuf {
    fn empty(slot: usize) -> HostBuf {
        HostBuf { slot, ..Default::default() }
    }
}

impl StepRows for HostBuf {
    fn row(&self, slot: usize, row: usize) -> &[u8] {
        match &self.codes {
            Some((c, _)) => &c[(slot * self.cap + row) * H..(slot * self.cap + row + 1) * H],
            None => &self.data[slot][row * H * 4..(row + 1) * H * 4],
        }
    }
    fn scale(&self, row: usize) -> Option<f32> {
        self.codes.as_ref().map(|(_, s)| s[row])
    }
    fn nonfinite(&self, slot: usize, row: usize) -> u32 {
        self.bad[slot][row]
    }
    fn row_sum(&self, slot: usize, row: usize) -> u64 {
        self.sums[slot][row]
    }
}

impl PinnedStep for HostBuf {
    fn ring_slot(&self) -> usize {
        self.slot
    }
    fn rows(&self) -> CoreResult<Box<dyn StepRows + Sync + '_>> {
        Ok(Box::new(self))
    }
    fn stamps(&self) -> CoreResult<Vec<Stamp>> {
        Ok(self.stamps.chunks_exact(STAMP_WORDS).map(Stamp::from_words).collect())
    }
}

impl DeviceBackend for HostDevice {
    fn capacity(&self) -> usize {
        self.layout.capacity
    }
    fn allocated(&self) -> (usize, usize) {
        (self.data.len() + self.sums.len() * 12, self.hosts.len() * self.layout.slots * self.layout.capacity * (H * 4 + 12))
    }
    fn free_host(&self, rows: usize) -> usize {
        self.pool.available(rows)
    }
    fn ring(&self) -> usize {
        (0..self.pool.len()).filter(|&i| self.pool.capacity(i) >= self.layout.capacity).count()
    }
    fn quantizes(&self) -> bool {
        self.quantize
    }
    fn arm(&mut self, arm: u32, rows: usize, runs: &[RowRun], _stream: u64) -> CoreResult<()> {
        assert!(self.armed.is_none(), "armed twice");
        let i = self.pool.take(rows)?;
        assert!(self.hosts[i].is_some(), "buffer {i} taken while handed out");
        for r in runs {
            for k in 0..r.len {
                self.src[r.dst_row + k] = (r.src_row + k) as i32;
            }
        }
        let half = self.next_half;
        self.next_half = 1 - half;
        let data_base = (half * self.layout.slots * self.layout.capacity) as u32;
        self.ctl = Control { arm, rows: rows as u32, data_base, half: half as u32 };
        self.armed = Some((half, rows));
        Ok(())
    }
    fn disarm(&mut self) -> CoreResult<()> {
        self.ctl = Control::DISARMED;
        self.armed = None;
        Ok(())
    }
    unsafe fn launch(
        &mut self,
        slot: usize,
        point: i32,
        hidden: &TensorDesc,
        residual: Option<&TensorDesc>,
        _stream: u64,
    ) -> CoreResult<()> {
        self.launches += 1;
        let as_cpu = |d: &TensorDesc| TensorDesc { device: Device::Cpu, ..d.clone() };
        let rows = hidden.rows();
        // SAFETY: the test's "device" tensors are live host memory.
        let h = unsafe { as_cpu(hidden).cpu_rows("h", rows)? };
        // SAFETY: as above.
        let r = match residual {
            Some(r) => Some(unsafe { as_cpu(r).cpu_rows("r", rows)? }),
            None => None,
        };
        let mut t = ArmedTarget {
            data: &mut self.data,
            dtype: DType::F32,
            row_sums: &mut self.sums,
            nonfinite: &mut self.bad,
            stamps: &mut self.stamps,
        };
        capture_armed(&self.ctl, &self.src, &h, r.as_ref(), slot, point, &self.layout, &mut t)
            .map_err(|e| crate::core_err!(ShapeContract, "{e}"))
    }
    fn end_step(&mut self) -> CoreResult<()> {
        let (half, n) = self.armed.take().expect("end_step without arm");
        self.ctl = Control::DISARMED;
        let i = self.pool.end()?;
        let slots = self.layout.slots;
        // Like a pinned buffer of the ring: its size class's rows (the step's own are copied below).
        let (cap, room) = (self.layout.capacity, self.pool.capacity(i));
        assert!(n <= room, "a step of {n} rows in a host buffer of {room}");
        let mut host = HostBuf { slot: i, cap: room, ..Default::default() };
        for s in 0..slots {
            let (d0, st0) = (half * slots * cap + s * cap, self.layout.stat_row(half, s, 0));
            host.data.push(self.data[d0 * H * 4..(d0 + n) * H * 4].to_vec());
            host.sums.push(self.sums[st0..st0 + n].to_vec());
            host.bad.push(self.bad[st0..st0 + n].to_vec());
        }
        host.stamps = self.stamps[self.layout.stamp_at(half, 0)..self.layout.stamp_at(half + 1, 0)].to_vec();
        if self.quantize {
            // Gather each row's slots (the arena is slot-major), quantize, scatter the codes back slot-major.
            let w = H;
            let mut rows = vec![0u8; n * slots * w * 4];
            for r in 0..n {
                for s in 0..slots {
                    rows[(r * slots + s) * w * 4..(r * slots + s + 1) * w * 4].copy_from_slice(&host.data[s][r * w * 4..(r + 1) * w * 4]);
                }
            }
            let (mut q, mut scales) = (vec![0u8; n * slots * w], vec![0f32; n]);
            hscapture_kernels::fp8::quantize(&rows, DType::F32, n, slots * w, &mut q, &mut scales);
            let mut codes = vec![0u8; slots * room * w];
            for r in 0..n {
                for s in 0..slots {
                    let at = (s * room + r) * w;
                    codes[at..at + w].copy_from_slice(&q[(r * slots + s) * w..(r * slots + s + 1) * w]);
                }
            }
            host.codes = Some((codes, scales));
        }
        self.hosts[i] = Some(host);
        Ok(())
    }
    fn wait(&mut self) -> CoreResult<Box<dyn PinnedStep>> {
        self.waits += 1;
        let i = self.pool.pop_oldest()?;
        Ok(Box::new(self.hosts[i].take().expect("the buffer is not handed out twice")))
    }
    fn recycle(&mut self, buf: Box<dyn PinnedStep>) -> CoreResult<()> {
        let i = buf.ring_slot();
        assert!(self.hosts[i].is_none(), "buffer {i} given back twice");
        self.pool.give_back(i)?;
        self.hosts[i] = Some(HostBuf::empty(i));
        Ok(())
    }
}
