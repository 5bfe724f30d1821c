//! The zip container of torch's archives (`torch.save` since 1.6): stored entries only (no
//! compression), each entry's data aligned to 64 bytes as torch aligns it (so that `torch.load(...,
//! mmap=True)` maps every storage at an aligned address), and zip64 fields when the archive reaches
//! 4 GiB. Sizes and CRC-32s are known before anything is written, so an archive is written in one
//! pass (no seeking back), through the same hashing writer as every other file.
//!
//! The reader checks what it relies on: the end-of-central-directory record, every entry stored and
//! inside the file (checked arithmetic on every offset), and each entry's CRC-32.

use std::borrow::Cow;

use crate::{bail, ensure, error::CoreResult};

/// Entry data starts at a multiple of this (torch's `.storage_alignment`).
pub const ALIGN: u64 = 64;
const LOCAL: u32 = 0x0403_4b50;
const CENTRAL: u32 = 0x0201_4b50;
const END: u32 = 0x0605_4b50;
const END64: u32 = 0x0606_4b50;
const LOCATOR64: u32 = 0x0706_4b50;
/// An extra field of padding (any id not reserved; torch uses "FB" as well).
const PAD_ID: u16 = 0x4246;
const ZIP64_ID: u16 = 0x0001;
const FLAG_UTF8: u16 = 0x0800;
const DOS_DATE_1980: u16 = 0x0021;

/// One entry: its name and its data as parts written back to back.
pub struct Entry<'a> {
    pub name: String,
    pub parts: Vec<Cow<'a, [u8]>>,
}

impl Entry<'_> {
    fn len(&self) -> u64 {
        self.parts.iter().map(|p| p.len() as u64).sum()
    }

    fn crc(&self) -> u32 {
        let mut h = crc32fast::Hasher::new();
        self.parts.iter().for_each(|p| h.update(p));
        h.finalize()
    }
}

fn put16(v: &mut Vec<u8>, x: u16) {
    v.extend_from_slice(&x.to_le_bytes());
}
fn put32(v: &mut Vec<u8>, x: u32) {
    v.extend_from_slice(&x.to_le_bytes());
}
fn put64(v: &mut Vec<u8>, x: u64) {
    v.extend_from_slice(&x.to_le_bytes());
}

/// The whole archive of `entries` as parts: headers (owned) around the entries' own parts.
/// `force_zip64` writes zip64 fields even for a small archive (tests).
pub fn archive<'a>(entries: Vec<Entry<'a>>, force_zip64: bool) -> Vec<Cow<'a, [u8]>> {
    let total: u64 = entries.iter().map(|e| e.len() + 256 + e.name.len() as u64).sum();
    let zip64 = force_zip64 || total >= u64::from(u32::MAX) - 4096;
    let mut out: Vec<Cow<'a, [u8]>> = Vec::new();
    let mut central = Vec::new();
    let mut offset = 0u64;
    let n = entries.len() as u64;
    for e in entries {
        let (size, crc) = (e.len(), e.crc());
        let name = e.name.as_bytes();
        let base = 30 + name.len() as u64 + if zip64 { 20 } else { 0 };
        // Padding extra field (4 bytes of header at least) so that the data starts aligned.
        let pad = (ALIGN - (offset + base + 4) % ALIGN) % ALIGN;
        let mut h = Vec::with_capacity((base + 4 + pad) as usize);
        put32(&mut h, LOCAL);
        put16(&mut h, if zip64 { 45 } else { 20 });
        put16(&mut h, FLAG_UTF8);
        put16(&mut h, 0); // stored
        put16(&mut h, 0);
        put16(&mut h, DOS_DATE_1980);
        put32(&mut h, crc);
        let small = if zip64 { u32::MAX } else { size as u32 };
        put32(&mut h, small);
        put32(&mut h, small);
        put16(&mut h, name.len() as u16);
        put16(&mut h, ((if zip64 { 20 } else { 0 }) + 4 + pad) as u16);
        h.extend_from_slice(name);
        if zip64 {
            put16(&mut h, ZIP64_ID);
            put16(&mut h, 16);
            put64(&mut h, size);
            put64(&mut h, size);
        }
        put16(&mut h, PAD_ID);
        put16(&mut h, pad as u16);
        h.resize(h.len() + pad as usize, 0);
        let header_len = h.len() as u64;
        out.push(Cow::Owned(h));
        // The central record of this entry.
        put32(&mut central, CENTRAL);
        put16(&mut central, 0x031e); // made by: unix, 3.0
        put16(&mut central, if zip64 { 45 } else { 20 });
        put16(&mut central, FLAG_UTF8);
        put16(&mut central, 0);
        put16(&mut central, 0);
        put16(&mut central, DOS_DATE_1980);
        put32(&mut central, crc);
        put32(&mut central, small);
        put32(&mut central, small);
        put16(&mut central, name.len() as u16);
        put16(&mut central, if zip64 { 28 } else { 0 });
        put16(&mut central, 0); // comment
        put16(&mut central, 0); // disk
        put16(&mut central, 0); // internal attributes
        put32(&mut central, 0o644 << 16); // external: a regular file, rw-r--r--
        put32(&mut central, if zip64 { u32::MAX } else { offset as u32 });
        central.extend_from_slice(name);
        if zip64 {
            put16(&mut central, ZIP64_ID);
            put16(&mut central, 24);
            put64(&mut central, size);
            put64(&mut central, size);
            put64(&mut central, offset);
        }
        offset += header_len + size;
        out.extend(e.parts);
    }
    let (cd_offset, cd_size) = (offset, central.len() as u64);
    let mut end = Vec::new();
    if zip64 {
        let end64_at = cd_offset + cd_size;
        put32(&mut end, END64);
        put64(&mut end, 44);
        put16(&mut end, 0x031e);
        put16(&mut end, 45);
        put32(&mut end, 0);
        put32(&mut end, 0);
        put64(&mut end, n);
        put64(&mut end, n);
        put64(&mut end, cd_size);
        put64(&mut end, cd_offset);
        put32(&mut end, LOCATOR64);
        put32(&mut end, 0);
        put64(&mut end, end64_at);
        put32(&mut end, 1);
    }
    put32(&mut end, END);
    put16(&mut end, 0);
    put16(&mut end, 0);
    let count = if zip64 { u16::MAX } else { n as u16 };
    put16(&mut end, count);
    put16(&mut end, count);
    put32(&mut end, if zip64 { u32::MAX } else { cd_size as u32 });
    put32(&mut end, if zip64 { u32::MAX } else { cd_offset as u32 });
    put16(&mut end, 0);
    out.push(Cow::Owned(central));
    out.push(Cow::Owned(end));
    out
}

/// Little-endian reads at checked offsets of a byte slice.
struct At<'a, 'w> {
    b: &'a [u8],
    what: &'w str,
}

impl<'a> At<'a, '_> {
    fn slice(&self, at: u64, n: u64) -> CoreResult<&'a [u8]> {
        let end = at.checked_add(n).filter(|&e| e <= self.b.len() as u64);
        let Some(end) = end else {
            bail!(
                Output,
                "{}: the zip structure points past the end of the file ({n} bytes at {at} of {}): the file is truncated or damaged",
                self.what,
                self.b.len()
            );
        };
        Ok(&self.b[at as usize..end as usize])
    }
    fn u16(&self, at: u64) -> CoreResult<u16> {
        let s = self.slice(at, 2)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&self, at: u64) -> CoreResult<u32> {
        let s = self.slice(at, 4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&self, at: u64) -> CoreResult<u64> {
        let s = self.slice(at, 8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
}

/// Reads a stored zip: `(name, data)` of every entry, in central-directory order, CRCs checked.
pub fn entries<'a>(bytes: &'a [u8], what: &str) -> CoreResult<Vec<(String, &'a [u8])>> {
    let at = At { b: bytes, what };
    ensure!(bytes.len() >= 22, Output, "{what}: {} bytes cannot hold a zip archive; the file is truncated", bytes.len());
    // The end record has no comment in the archives read here; allow a short one anyway.
    let lo = bytes.len().saturating_sub(22 + 1024);
    let Some(end) = (lo..=bytes.len() - 22).rev().find(|&i| bytes[i..i + 4] == END.to_le_bytes()) else {
        bail!(Output, "{what}: no zip end-of-directory record: not a torch archive, or truncated");
    };
    let end = end as u64;
    let (mut count, mut cd_size, mut cd_offset) =
        (u64::from(at.u16(end + 10)?), u64::from(at.u32(end + 12)?), u64::from(at.u32(end + 16)?));
    if count == u64::from(u16::MAX) || cd_size == u64::from(u32::MAX) || cd_offset == u64::from(u32::MAX) {
        ensure!(end >= 20 && at.u32(end - 20)? == LOCATOR64, Output, "{what}: a zip64 archive without its locator; the file is damaged");
        let e64 = at.u64(end - 12)?;
        ensure!(at.u32(e64)? == END64, Output, "{what}: the zip64 end record is missing; the file is damaged");
        (count, cd_size, cd_offset) = (at.u64(e64 + 32)?, at.u64(e64 + 40)?, at.u64(e64 + 48)?);
    }
    at.slice(cd_offset, cd_size)?;
    let mut out = Vec::new();
    let mut p = cd_offset;
    for _ in 0..count {
        ensure!(at.u32(p)? == CENTRAL, Output, "{what}: a damaged zip directory entry at {p}");
        ensure!(at.u16(p + 10)? == 0, Output, "{what}: a compressed zip entry; torch archives store their entries");
        let crc = at.u32(p + 16)?;
        let (mut size, mut offset) = (u64::from(at.u32(p + 24)?), u64::from(at.u32(p + 42)?));
        let (nlen, xlen, clen) = (u64::from(at.u16(p + 28)?), u64::from(at.u16(p + 30)?), u64::from(at.u16(p + 32)?));
        let name = String::from_utf8_lossy(at.slice(p + 46, nlen)?).into_owned();
        let mut x = p + 46 + nlen;
        let xend = x + xlen;
        while x + 4 <= xend {
            let (id, len) = (at.u16(x)?, u64::from(at.u16(x + 2)?));
            if id == ZIP64_ID {
                let mut f = x + 4;
                if size == u64::from(u32::MAX) {
                    size = at.u64(f)?;
                    f += 8;
                    f += 8; // the compressed size, equal for stored entries
                }
                if offset == u64::from(u32::MAX) {
                    offset = at.u64(f)?;
                }
            }
            x += 4 + len;
        }
        ensure!(at.u32(offset)? == LOCAL, Output, "{what}: entry {name} has no local header at {offset}; the file is damaged");
        let data_at = offset + 30 + u64::from(at.u16(offset + 26)?) + u64::from(at.u16(offset + 28)?);
        let data = at.slice(data_at, size)?;
        ensure!(crc32fast::hash(data) == crc, Output, "{what}: entry {name} fails its CRC-32: the file changed after it was written");
        out.push((name, data));
        p = xend + clen;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(force64: bool) -> Vec<u8> {
        let big: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        let e = vec![
            Entry { name: "archive/data.pkl".into(), parts: vec![Cow::Borrowed(b"abc")] },
            Entry { name: "archive/data/0".into(), parts: vec![Cow::Borrowed(&big[..500]), Cow::Owned(big[500..].to_vec())] },
        ];
        archive(e, force64).concat()
    }

    #[test]
    fn entries_read_back_aligned_with_and_without_zip64() {
        for force in [false, true] {
            let z = build(force);
            let got = entries(&z, "t").unwrap();
            assert_eq!(got.len(), 2);
            assert_eq!((got[0].0.as_str(), got[0].1), ("archive/data.pkl", &b"abc"[..]));
            assert_eq!(got[1].1.len(), 1000);
            for (_, d) in &got {
                let at = d.as_ptr() as usize - z.as_ptr() as usize;
                assert_eq!(at % ALIGN as usize, 0, "data aligned to 64 (zip64 {force})");
            }
        }
    }

    #[test]
    fn damage_is_an_error_never_a_panic() {
        let z = build(false);
        for cut in [0, 10, 21, z.len() / 2, z.len() - 1] {
            assert!(entries(&z[..cut], "t").is_err(), "truncated at {cut}");
        }
        let mut flipped = z.clone();
        flipped[200] ^= 0x10; // inside data/0
        assert!(entries(&flipped, "t").unwrap_err().message.contains("CRC"));
        for i in 0..z.len() {
            let mut b = z.clone();
            b[i] ^= 0xff;
            let _ = entries(&b, "t"); // any byte damaged: an error or the same entries, never a panic
        }
    }
}
