//! What both sides of the core share, at its bottom: a sample ([`Sample`], named by a [`SampleKey`]) as capture
//! assembles it and output stores it, a sample read back ([`LoadedSample`]), the recycled buffers its bytes live in
//! ([`pool`]), the check for states no layer produces ([`degenerate`]), and the [`Handoff`] through which capture
//! passes samples on to the output without knowing it. It imports nothing of the core but its error type.

pub mod degenerate;
pub mod pool;

use std::collections::HashMap;

use crate::error::CoreResult;
use hscapture_kernels::DType;

/// How a finished sample is named: by its index in the input (`hs_{i}`) or by vLLM's request id.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SampleKey {
    Index(u64),
    Request(String),
}

impl std::fmt::Display for SampleKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SampleKey::Index(i) => write!(f, "sample {i}"),
            SampleKey::Request(r) => write!(f, "request {r:?}"),
        }
    }
}

/// Where capture hands its finished samples on, each with the step that completed it (the output's release gate
/// implements it, `output/gate.rs`): all that capture knows of writing.
pub trait Handoff: Send + Sync {
    /// Hands `sample` on if there is room now; gives it back when there is none.
    fn try_submit(&self, step: u64, sample: Sample) -> CoreResult<Option<Sample>>;
    /// Hands `sample` on, waiting for room (backpressure); reports an earlier failure of the output.
    fn submit(&self, step: u64, sample: Sample) -> CoreResult<()>;
}

/// `hidden_states` `[rows, slots, width]` in `dtype` (row-major) and the prompt's `token_ids` — or, with `scales`,
/// those states quantized on the device: e4m3fn codes (one byte per value) and one scale per row (`output/fp8.rs`).
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
    /// The training mask of the prompt's tokens (0/1), when the input has one (the `legacy` format
    /// stores it; all ones without).
    pub loss_mask: Option<Vec<u8>>,
    pub scales: Option<Vec<f32>>,
}

/// A sample file read back: `data` is `[shape[0], shape[1], shape[2]]` in `dtype`, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedSample {
    pub token_ids: Vec<i64>,
    pub shape: [usize; 3],
    pub dtype: DType,
    pub data: Vec<u8>,
    pub metadata: HashMap<String, String>,
    pub loss_mask: Option<Vec<u8>>,
    /// The whole file's checksum (what its record must carry).
    pub checksum: String,
    /// torch name of the dtype on disk (`float8_e4m3fn` for fp8 files, whose `data` is dequantized).
    pub stored: String,
}

impl LoadedSample {
    pub fn new(token_ids: Vec<i64>, shape: [usize; 3], dtype: DType, data: Vec<u8>, metadata: HashMap<String, String>) -> Self {
        let stored = dtype.torch_name().to_string();
        LoadedSample { token_ids, shape, dtype, data, metadata, loss_mask: None, checksum: String::new(), stored }
    }
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

    /// Bytes of one stored value (1 for fp8 codes).
    pub fn value_bytes(&self) -> usize {
        if self.scales.is_some() {
            1
        } else {
            self.dtype.size()
        }
    }

    /// Row `pos`, slot `slot` as bytes.
    pub fn cell(&self, pos: usize, slot: usize) -> &[u8] {
        let rb = self.width * self.value_bytes();
        let o = (pos * self.slots + slot) * rb;
        &self.data[o..o + rb]
    }
}

/// See [`Sample::file_stem`].
pub fn file_stem(key: &SampleKey) -> String {
    match key {
        SampleKey::Index(i) => format!("hs_{i}"),
        SampleKey::Request(r) => format!("hs_req-{}", request_stem(r)),
    }
}

/// Longest request id used verbatim in a file name (the lock and the writer's hidden partial name add to it, and a
/// file name has at most 255 bytes).
pub const VERBATIM_MAX: usize = 96;
/// Characters of an unsafe or long id kept, before its digest, as a readable prefix.
const PREFIX_MAX: usize = 48;

fn safe_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')
}

/// A request id as a file name's stem, bounded, safe and distinct for distinct ids, whatever the client sent (vLLM
/// builds its ids from the client's `X-Request-Id`):
/// - an id of at most [`VERBATIM_MAX`] characters from `[A-Za-z0-9._-]`, not starting with `.`: the id itself;
/// - any other: up to 48 of its characters made safe (`_` for the rest, leading dots dropped), `~`, and the 128-bit
///   xxh3 digest of its bytes in hex. `~` never appears in a verbatim stem, so the two forms never meet, and two ids
///   share a digest stem only if their digests collide.
pub fn request_stem(req_id: &str) -> String {
    if !req_id.is_empty() && req_id.len() <= VERBATIM_MAX && !req_id.starts_with('.') && req_id.chars().all(safe_char) {
        return req_id.to_string();
    }
    let prefix: String = req_id.chars().take(PREFIX_MAX).map(|c| if safe_char(c) { c } else { '_' }).collect();
    format!("{}~{:032x}", prefix.trim_start_matches('.'), xxhash_rust::xxh3::xxh3_128(req_id.as_bytes()))
}
