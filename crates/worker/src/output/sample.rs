//! An assembled sample: every captured layer of every prompt token of one request.

use crate::attribution::plan::SampleKey;
use hscapture_kernels::DType;

/// `hidden_states` `[rows, slots, width]` in `dtype` (row-major) and the prompt's `token_ids`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub key: SampleKey,
    pub req_id: String,
    pub token_ids: Vec<i64>,
    pub data: Vec<u8>,
    pub rows: usize,
    pub slots: usize,
    pub width: usize,
    pub dtype: DType,
}

impl Sample {
    /// File stem: `hs_{i}` for an indexed sample, `hs_req-{id}` (id reduced to safe characters) for one
    /// named by request id.
    pub fn file_stem(&self) -> String {
        file_stem(&self.key)
    }

    pub fn shape(&self) -> [usize; 3] {
        [self.rows, self.slots, self.width]
    }

    /// Row `pos`, slot `slot` as bytes.
    pub fn cell(&self, pos: usize, slot: usize) -> &[u8] {
        let rb = self.width * self.dtype.size();
        let o = (pos * self.slots + slot) * rb;
        &self.data[o..o + rb]
    }
}

/// See [`Sample::file_stem`].
pub fn file_stem(key: &SampleKey) -> String {
    match key {
        SampleKey::Index(i) => format!("hs_{i}"),
        SampleKey::Request(r) => {
            let safe: String = r
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' { c } else { '_' })
                .collect();
            format!("hs_req-{safe}")
        }
    }
}

/// xxh3-64 of the hidden-state bytes, as `xxh3:<16 hex digits>` (what the manifest records).
pub fn content_checksum(data: &[u8]) -> String {
    format!("xxh3:{:016x}", xxhash_rust::xxh3::xxh3_64(data))
}
