//! Pipeline stages: the rows one stage captured in a step (the slots of the layers it owns), as one
//! message for the stage that assembles. Every stage sees the same scheduler outputs and plans each
//! step identically, so a message is checked against the receiver's own plan (step and row count)
//! and its slots are written into the receiver's arena as if captured there.
//!
//! Layout, little-endian: `b"HSPP"`, u32 version (1), u64 step, u64 rows, u64 row bytes, u32 slot
//! count, then per slot: u32 slot, `rows * row_bytes` data, `rows` u64 row sums, `rows` u32 non-finite
//! counts.

use crate::{bail, ensure, error::CoreResult};

const MAGIC: &[u8; 4] = b"HSPP";
const VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotPart {
    pub slot: usize,
    pub data: Vec<u8>,
    pub row_sums: Vec<u64>,
    pub nonfinite: Vec<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageMessage {
    pub step: u64,
    pub rows: usize,
    pub row_bytes: usize,
    pub parts: Vec<SlotPart>,
}

struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> CoreResult<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.buf.len());
        let Some(end) = end else {
            bail!(
                RankMismatch,
                "pipeline-stage message truncated: {what} needs {n} bytes at offset {}, the message has {}",
                self.at,
                self.buf.len()
            );
        };
        let s = &self.buf[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> CoreResult<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> CoreResult<u64> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn size(&mut self, what: &str) -> CoreResult<usize> {
        let v = self.u64(what)?;
        usize::try_from(v).map_err(|_| crate::core_err!(RankMismatch, "pipeline-stage message: {what} {v} does not fit"))
    }
}

impl StageMessage {
    pub fn encode(&self) -> Vec<u8> {
        let per = self.rows * (self.row_bytes + 12) + 4;
        let mut out = Vec::with_capacity(32 + self.parts.len() * per);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&self.step.to_le_bytes());
        out.extend_from_slice(&(self.rows as u64).to_le_bytes());
        out.extend_from_slice(&(self.row_bytes as u64).to_le_bytes());
        out.extend_from_slice(&(self.parts.len() as u32).to_le_bytes());
        for p in &self.parts {
            out.extend_from_slice(&(p.slot as u32).to_le_bytes());
            out.extend_from_slice(&p.data);
            p.row_sums.iter().for_each(|s| out.extend_from_slice(&s.to_le_bytes()));
            p.nonfinite.iter().for_each(|c| out.extend_from_slice(&c.to_le_bytes()));
        }
        out
    }

    pub fn decode(buf: &[u8]) -> CoreResult<StageMessage> {
        let mut r = Reader { buf, at: 0 };
        ensure!(
            r.take(4, "magic")? == MAGIC,
            RankMismatch,
            "pipeline-stage message does not start with {MAGIC:?}: another message was received in its place"
        );
        let v = r.u32("version")?;
        ensure!(v == VERSION, RankMismatch, "pipeline-stage message version {v}, expected {VERSION}: mixed hscapture versions?");
        let step = r.u64("step")?;
        let rows = r.size("rows")?;
        let row_bytes = r.size("row bytes")?;
        let n = r.u32("slot count")? as usize;
        let mut parts = Vec::with_capacity(n);
        for _ in 0..n {
            let slot = r.u32("slot")? as usize;
            let data = r.take(rows.saturating_mul(row_bytes), "rows")?.to_vec();
            let row_sums = r.take(rows * 8, "row sums")?.chunks_exact(8).map(|c| {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                u64::from_le_bytes(a)
            });
            let row_sums = row_sums.collect();
            let nonfinite = r.take(rows * 4, "non-finite counts")?.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            parts.push(SlotPart { slot, data, row_sums, nonfinite: nonfinite.collect() });
        }
        ensure!(r.at == buf.len(), RankMismatch, "pipeline-stage message has {} trailing bytes", buf.len() - r.at);
        Ok(StageMessage { step, rows, row_bytes, parts })
    }
}

#[cfg(test)]
#[path = "tests/stage_message.rs"]
mod tests;
