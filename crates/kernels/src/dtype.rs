//! Element types the capture path reads and writes.

use half::{bf16, f16};

/// Floating-point element types of hidden states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
}

impl DType {
    /// Every dtype, in the order the docs list them.
    pub const ALL: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// The name safetensors and the manifest use (`F32`, `BF16`, `F16`).
    pub const fn safetensors_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::BF16 => "BF16",
            DType::F16 => "F16",
        }
    }

    /// The name torch uses without the `torch.` prefix.
    pub const fn torch_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
        }
    }

    /// Parses torch names (`torch.float32`, `float32`, `float`), safetensors names (`F32`) and
    /// the short names the CLI accepts (`bf16`, `fp16`, `fp32`).
    pub fn parse(name: &str) -> Option<DType> {
        let n = name.trim().trim_start_matches("torch.").to_ascii_lowercase();
        match n.as_str() {
            "float32" | "float" | "f32" | "fp32" => Some(DType::F32),
            "bfloat16" | "bf16" => Some(DType::BF16),
            "float16" | "half" | "f16" | "fp16" => Some(DType::F16),
            _ => None,
        }
    }

    /// Reads element `i` of a little-endian buffer of this dtype as f32 (exact for every dtype here).
    #[inline(always)]
    pub fn load(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            DType::F32 => {
                let o = i * 4;
                f32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]])
            }
            DType::BF16 => {
                let o = i * 2;
                bf16::from_bits(u16::from_le_bytes([bytes[o], bytes[o + 1]])).to_f32()
            }
            DType::F16 => {
                let o = i * 2;
                f16::from_bits(u16::from_le_bytes([bytes[o], bytes[o + 1]])).to_f32()
            }
        }
    }

    /// Rounds `v` to this dtype (round to nearest even, as torch does) and stores it at element `i`;
    /// returns the stored bit pattern, zero-extended, and whether the stored value is finite.
    #[inline(always)]
    pub fn store(self, bytes: &mut [u8], i: usize, v: f32) -> (u64, bool) {
        match self {
            DType::F32 => {
                let o = i * 4;
                bytes[o..o + 4].copy_from_slice(&v.to_le_bytes());
                (u64::from(v.to_bits()), v.is_finite())
            }
            DType::BF16 => {
                let h = bf16::from_f32(v);
                let o = i * 2;
                bytes[o..o + 2].copy_from_slice(&h.to_bits().to_le_bytes());
                (u64::from(h.to_bits()), h.is_finite())
            }
            DType::F16 => {
                let h = f16::from_f32(v);
                let o = i * 2;
                bytes[o..o + 2].copy_from_slice(&h.to_bits().to_le_bytes());
                (u64::from(h.to_bits()), h.is_finite())
            }
        }
    }

    /// The bit pattern of element `i`, zero-extended (what checksums are computed over).
    #[inline(always)]
    pub fn bits(self, bytes: &[u8], i: usize) -> u64 {
        match self {
            DType::F32 => {
                let o = i * 4;
                u64::from(u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]))
            }
            DType::BF16 | DType::F16 => {
                let o = i * 2;
                u64::from(u16::from_le_bytes([bytes[o], bytes[o + 1]]))
            }
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.torch_name())
    }
}

#[cfg(test)]
#[path = "tests/dtype.rs"]
mod tests;
