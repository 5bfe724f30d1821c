//! One page-locked host allocation per step buffer, carved into regions (`ring.rs`), without cudarc's per-slice
//! event: a `PinnedHostSlice` makes every copy into it wait on its event and every read synchronise it, two driver
//! calls per region per step (13 regions a 4-layer decode step: ~26 calls, ~50 µs of the engine's thread on the
//! H200). The ring's `copies_done` event already orders each buffer's copies before its reads.

use std::sync::Arc;

use cudarc::driver::{result, CudaContext, DriverError};

/// `len` bytes of page-locked host memory of `ctx`, freed on drop.
pub struct PinnedBlock {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the block is plain host memory owned by this value; who writes and who reads it when is ordered by the
// ring (copies enqueued only into a buffer no step shares, read only after its `copies_done` event), not by the
// thread that holds the pointer.
unsafe impl Send for PinnedBlock {}
// SAFETY: shared references only read (`slice`); writes go through the copy engine under the ring's rules above.
unsafe impl Sync for PinnedBlock {}

impl PinnedBlock {
    /// Not write-combined (the assembler thread reads it).
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<PinnedBlock, DriverError> {
        ctx.bind_to_thread()?;
        // SAFETY: a plain allocation of `len` bytes (at least one: CUDA refuses zero) in the bound context.
        let ptr = unsafe { result::malloc_host(len.max(1), 0) }? as *mut u8;
        Ok(PinnedBlock { ptr, len, ctx: Arc::clone(ctx) })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The host address at byte `at` (`at <= len`), for a copy's destination.
    pub fn addr(&self, at: usize) -> Option<*mut u8> {
        // SAFETY: `at` is within the allocation or one past its end (checked).
        (at <= self.len).then(|| unsafe { self.ptr.add(at) })
    }

    /// `n` values of `T` from byte `at`, or None past the block's end or off `T`'s alignment.
    ///
    /// # Safety
    /// No copy may write these bytes while the slice lives (the ring's `copies_done` for this buffer has completed
    /// and the buffer is not given to another step until the slice is dropped). `T` must be valid for every bit
    /// pattern (u8, u32, u64, f32).
    pub unsafe fn slice<T: Copy>(&self, at: usize, n: usize) -> Option<&[T]> {
        let bytes = n.checked_mul(std::mem::size_of::<T>())?;
        let end = at.checked_add(bytes)?;
        let p = self.addr(at)?;
        if end > self.len || !(p as *const T).is_aligned() {
            return None;
        }
        // SAFETY: in bounds and aligned (checked); every bit pattern is a `T` and nothing writes the bytes meanwhile
        // (the caller's contract).
        Some(unsafe { std::slice::from_raw_parts(p as *const T, n) })
    }
}

impl Drop for PinnedBlock {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by `cuMemHostAlloc` in this context; the copy stream that wrote it was synchronised
        // before the device's buffers are dropped (`CudaDevice`'s `Drop`), and no slice outlives the block.
        let _ = unsafe { result::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}
