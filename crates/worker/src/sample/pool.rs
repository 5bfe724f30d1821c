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

    /// A buffer of `n` bytes, reusing an idle one when one is large enough. Its contents are
    /// unspecified (a reused buffer keeps its earlier bytes, a new one is zeroed lazily by the OS):
    /// the caller overwrites every byte. Not zeroing a reused buffer saves a pass over it, which for a
    /// step of large prompts was most of the assembly's time (512 MiB per Llama-8B step).
    pub fn get(&self, n: usize) -> Vec<u8> {
        let reused = {
            let mut g = self.free.lock().unwrap_or_else(|p| p.into_inner());
            g.iter().position(|b| b.capacity() >= n).map(|i| g.swap_remove(i))
        };
        match reused {
            Some(mut v) if v.len() >= n => {
                v.truncate(n);
                v
            }
            Some(mut v) => {
                v.resize(n, 0); // zeroes only the bytes past the old length
                v
            }
            None => vec![0; n],
        }
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

#[cfg(test)]
mod tests {
    use super::BufferPool;

    #[test]
    fn a_reused_buffer_keeps_its_allocation_and_is_not_rewritten() {
        let pool = BufferPool::new(2);
        let v = vec![7u8; 4096];
        let ptr = v.as_ptr();
        pool.put(v);
        let got = pool.get(1024);
        assert_eq!((got.len(), got.as_ptr()), (1024, ptr), "the idle buffer is reused in place");
        assert!(got.iter().all(|&b| b == 7), "no zeroing pass over a reused buffer");
        pool.put(got);
        let longer = pool.get(3000);
        assert_eq!((longer.len(), longer.as_ptr()), (3000, ptr));
        assert!(longer[1024..].iter().all(|&b| b == 0), "bytes past the old length are zeroed");
        assert!(pool.get(8192).iter().all(|&b| b == 0), "a new buffer is zeroed");
        assert_eq!(pool.idle_bytes(), 0);
    }
}
