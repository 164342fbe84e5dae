//! Sparse host bytes behind one physical object (a segment or a page), and the test pattern.

use std::collections::HashMap;
use std::fmt;

/// Host memory is allocated in chunks of this many bytes, on first write.
pub(crate) const CHUNK: u64 = 64 << 10;

/// The bytes of one physical object. Chunks never written read as `fresh`.
pub(crate) struct Store {
    /// What never-written bytes read as.
    fresh: u8,
    /// Chunk index -> `CHUNK` bytes.
    chunks: HashMap<u64, Box<[u8]>>,
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("fresh", &self.fresh)
            .field("chunks", &self.chunks.len())
            .finish()
    }
}

impl Store {
    /// An empty store whose bytes all read as `fresh`.
    pub(crate) fn new(fresh: u8) -> Self {
        Store {
            fresh,
            chunks: HashMap::new(),
        }
    }

    /// Host bytes held.
    pub(crate) fn host_bytes(&self) -> u64 {
        self.chunks.len() as u64 * CHUNK
    }

    /// Copies `buf.len()` bytes starting at `off` into `buf`.
    pub(crate) fn read_into(&self, mut off: u64, buf: &mut [u8]) {
        let mut done = 0;
        while done < buf.len() {
            let (index, within, n) = span(off, buf.len() - done);
            let dst = &mut buf[done..done + n];
            match self.chunks.get(&index) {
                Some(chunk) => dst.copy_from_slice(&chunk[within..within + n]),
                None => dst.fill(self.fresh),
            }
            done += n;
            off += n as u64;
        }
    }

    /// Copies `buf` to the bytes starting at `off`, allocating chunks as needed.
    pub(crate) fn write_from(&mut self, mut off: u64, buf: &[u8]) {
        let mut done = 0;
        while done < buf.len() {
            let (index, within, n) = span(off, buf.len() - done);
            let fresh = self.fresh;
            let chunk = self
                .chunks
                .entry(index)
                .or_insert_with(|| vec![fresh; CHUNK as usize].into_boxed_slice());
            chunk[within..within + n].copy_from_slice(&buf[done..done + n]);
            done += n;
            off += n as u64;
        }
    }
}

/// The chunk holding `off`, the offset within it, and how many of `left` bytes fit in it.
fn span(off: u64, left: usize) -> (u64, usize, usize) {
    let within = (off % CHUNK) as usize;
    (off / CHUNK, within, left.min(CHUNK as usize - within))
}

/// Byte `offset` of the deterministic test pattern for `seed` (what [`SimDevice::fill`] writes
/// at `ptr + offset`).
///
/// [`SimDevice::fill`]: crate::SimDevice::fill
pub fn pattern_byte(seed: u64, offset: u64) -> u8 {
    pattern_word(seed, offset / 8).to_le_bytes()[(offset % 8) as usize]
}

/// Fills `buf` with the pattern for `seed`, starting at pattern offset `offset`: a word at a time
/// where the offset is word-aligned, a byte at a time at the ragged ends.
pub(crate) fn pattern_into(seed: u64, offset: u64, buf: &mut [u8]) {
    let len = buf.len();
    let head = ((8 - offset % 8) % 8).min(len as u64) as usize;
    let (first, rest) = buf.split_at_mut(head);
    for (i, b) in first.iter_mut().enumerate() {
        *b = pattern_byte(seed, offset + i as u64);
    }
    let word0 = (offset + head as u64) / 8;
    let mut words = rest.chunks_exact_mut(8);
    for (i, w) in words.by_ref().enumerate() {
        w.copy_from_slice(&pattern_word(seed, word0 + i as u64).to_le_bytes());
    }
    let tail = words.into_remainder();
    let at = offset + (len - tail.len()) as u64;
    for (i, b) in tail.iter_mut().enumerate() {
        *b = pattern_byte(seed, at + i as u64);
    }
}

/// splitmix64 of (seed, word index): neighbouring words and seeds give unrelated values.
fn pattern_word(seed: u64, word: u64) -> u64 {
    let mut z = seed
        .wrapping_mul(0xD6E8_FEB8_6659_FD93)
        .wrapping_add(word.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_into_agrees_with_pattern_byte_at_every_alignment() {
        for offset in 0..17u64 {
            for len in [0usize, 1, 5, 8, 9, 23, 64] {
                let mut buf = vec![0; len];
                pattern_into(11, offset, &mut buf);
                let want: Vec<u8> = (0..len as u64)
                    .map(|i| pattern_byte(11, offset + i))
                    .collect();
                assert_eq!(buf, want, "offset {offset}, len {len}");
            }
        }
    }
}
