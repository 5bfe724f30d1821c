//! Recycled sample buffers: a sample's bytes go from assembly to the writer, and back here once the
//! file is written, so that steady-state capture allocates (and page-faults) no new memory.

use std::sync::Mutex;

#[derive(Debug)]
pub struct BufferPool {
    free: Mutex<Vec<Vec<u8>>>,
    max: usize,
}

impl BufferPool {
    /// A pool keeping at most `max` idle buffers.
    pub fn new(max: usize) -> BufferPool {
        BufferPool { free: Mutex::new(Vec::new()), max }
    }

    /// A zeroed buffer of `n` bytes, reusing an idle one when one is large enough.
    pub fn get(&self, n: usize) -> Vec<u8> {
        let reused = {
            let mut g = self.free.lock().unwrap_or_else(|p| p.into_inner());
            g.iter().position(|b| b.capacity() >= n).map(|i| g.swap_remove(i))
        };
        let mut v = reused.unwrap_or_default();
        v.clear();
        v.resize(n, 0);
        v
    }

    /// Returns a buffer for reuse (dropped when the pool is full).
    pub fn put(&self, v: Vec<u8>) {
        let mut g = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if g.len() < self.max && v.capacity() > 0 {
            g.push(v);
        }
    }

    pub fn idle_bytes(&self) -> usize {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).iter().map(Vec::capacity).sum()
    }
}
