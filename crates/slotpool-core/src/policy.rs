//! Size policy, compatible with PyTorch 2.11's `CUDACachingAllocator` so that traces compare.
//!
//! Every rule here is pinned to PyTorch's constants by the unit tests at the bottom of the file.

/// Smallest block; every request rounds up to a multiple of this (`kMinBlockSize`).
pub const MIN_BLOCK_SIZE: u64 = 512;
/// Largest request served from the small pool (`kSmallSize`).
pub const SMALL_SIZE: u64 = 1 << 20;
/// Segment size for small requests (`kSmallBuffer`).
pub const SMALL_BUFFER: u64 = 2 << 20;
/// Segment size for requests between 1 and 10 MiB (`kLargeBuffer`, `large_segment_size_mb`).
pub const LARGE_BUFFER: u64 = 20 << 20;
/// Requests at or above this get a segment of their own size rounded to 2 MiB (`kMinLargeAlloc`).
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Rounding of large segments (`kRoundLarge`).
pub const ROUND_LARGE: u64 = 2 << 20;
/// Number of `roundup_power2_divisions` buckets: one per power of two from 1 MiB to 64 GiB.
pub const ROUNDUP_BUCKETS: usize = 16;

/// The size rules of one allocator, as PyTorch's `PYTORCH_CUDA_ALLOC_CONF` sets them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SizePolicy {
    /// `roundup_power2_divisions` per bucket (bucket i covers sizes in [2^(20+i), 2^(21+i))); 0 or 1
    /// means plain 512 B rounding.
    pub roundup_power2_divisions: [u64; ROUNDUP_BUCKETS],
    /// `max_split_size_mb` in bytes; `u64::MAX` = unlimited (the default).
    pub max_split_size: u64,
    /// `max_non_split_rounding_mb` in bytes (default 20 MiB).
    pub max_non_split_rounding: u64,
    /// `large_segment_size_mb` in bytes (default 20 MiB).
    pub large_segment_size: u64,
}

impl Default for SizePolicy {
    fn default() -> Self {
        SizePolicy {
            roundup_power2_divisions: [0; ROUNDUP_BUCKETS],
            max_split_size: u64::MAX,
            max_non_split_rounding: 20 << 20,
            large_segment_size: LARGE_BUFFER,
        }
    }
}

fn floor_log2(x: u64) -> u32 {
    63 - x.leading_zeros()
}

impl SizePolicy {
    /// The divisions that apply to `size` (`roundup_power2_divisions(size)`).
    #[inline]
    pub fn divisions_for(&self, size: u64) -> u64 {
        let log = floor_log2(size.max(1));
        let index = log.saturating_sub(20).min(ROUNDUP_BUCKETS as u32 - 1);
        self.roundup_power2_divisions[index as usize]
    }

    /// The block size a request of `size` bytes gets (`round_size`). Inlined: every allocation
    /// calls it.
    #[inline]
    pub fn round_size(&self, size: u64) -> u64 {
        if size < MIN_BLOCK_SIZE {
            return MIN_BLOCK_SIZE;
        }
        let divisions = self.divisions_for(size);
        if divisions > 1 && size > MIN_BLOCK_SIZE * divisions {
            roundup_power2_next_division(size, divisions)
        } else {
            size.div_ceil(MIN_BLOCK_SIZE).saturating_mul(MIN_BLOCK_SIZE)
        }
    }

    /// The segment size classic growth asks the backend for (`get_allocation_size`).
    pub fn segment_size(&self, rounded: u64) -> u64 {
        if rounded <= SMALL_SIZE {
            SMALL_BUFFER
        } else if rounded < MIN_LARGE_ALLOC {
            self.large_segment_size
        } else {
            rounded.div_ceil(ROUND_LARGE).saturating_mul(ROUND_LARGE)
        }
    }

    /// Whether a block of `block_size` serving `size` bytes is split (`should_split`), for classic
    /// segments. vmm segments split whenever the remainder is at least 512 B, as PyTorch's
    /// expandable segments do.
    pub fn should_split(&self, block_size: u64, size: u64, small: bool, vmm: bool) -> bool {
        let remaining = block_size - size;
        if small || vmm {
            remaining >= MIN_BLOCK_SIZE
        } else {
            size < self.max_split_size && remaining > SMALL_SIZE
        }
    }

    /// Whether a cached free block of `block_size` may serve a request of `size` bytes under the
    /// `max_split_size` rules (`get_free_block`'s two refusals).
    pub fn may_serve(&self, block_size: u64, size: u64) -> bool {
        if size < self.max_split_size && block_size >= self.max_split_size {
            return false;
        }
        if size >= self.max_split_size
            && block_size >= size.saturating_add(self.max_non_split_rounding)
        {
            return false;
        }
        true
    }

    /// Whether a block of this size counts as oversize (`oversize_allocations`).
    pub fn is_oversize(&self, size: u64) -> bool {
        size >= self.max_split_size
    }
}

/// Whether a rounded request belongs to the small pool (`get_pool`).
pub fn is_small(rounded: u64) -> bool {
    rounded <= SMALL_SIZE
}

/// `roundup_power2_next_division`: round `size` up to the next 1/`divisions` step between two
/// powers of two.
fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << floor_log2(size);
    let step = floor >> floor_log2(divisions);
    if step == 0 {
        return floor << 1;
    }
    let down = size & !(step - 1);
    if down == size { size } else { down + step }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn round_size_matches_pytorch_default() {
        let p = SizePolicy::default();
        assert_eq!(p.round_size(0), 512);
        assert_eq!(p.round_size(1), 512);
        assert_eq!(p.round_size(511), 512);
        assert_eq!(p.round_size(512), 512);
        assert_eq!(p.round_size(513), 1024);
        assert_eq!(p.round_size(3072), 3072);
        assert_eq!(p.round_size(154_389_504), 154_389_504);
        assert_eq!(p.round_size(1_000_001), 1_000_448);
    }

    #[test]
    fn roundup_power2_divisions_match_pytorch() {
        let mut p = SizePolicy {
            roundup_power2_divisions: [4; ROUNDUP_BUCKETS],
            ..Default::default()
        };
        // PyTorch's own example: 1200 B with 4 divisions stays on 512 B steps below 512*4...
        assert_eq!(p.round_size(1200), 1536);
        // ...and above it rounds to quarter steps between powers of two.
        assert_eq!(p.round_size(2049 + 512), 3072);
        assert_eq!(p.round_size(5 * MIB + 1), 6 * MIB);
        assert_eq!(p.round_size(4 * MIB), 4 * MIB);
        assert_eq!(p.round_size(9 * MIB), 10 * MIB);
        // Divisions apply only above 512 B x divisions: below that, plain 512 B rounding.
        p.roundup_power2_divisions = [1 << 20; ROUNDUP_BUCKETS];
        assert_eq!(p.round_size(600 * 1024 + 1), 1201 * 512);
        // Bucket selection: sizes under 1 MiB use bucket 0, 64 GiB and above the last.
        let mut p = SizePolicy::default();
        p.roundup_power2_divisions[0] = 2;
        p.roundup_power2_divisions[1] = 8;
        assert_eq!(p.divisions_for(1000), 2);
        assert_eq!(p.divisions_for(MIB + 5), 2);
        assert_eq!(p.divisions_for(2 * MIB), 8);
        assert_eq!(p.divisions_for(1 << 40), 0);
        assert_eq!(p.round_size(3 * MIB + 1), 3 * MIB + MIB / 4);
    }

    #[test]
    fn segment_sizes_match_pytorch() {
        let p = SizePolicy::default();
        assert_eq!(p.segment_size(512), 2 * MIB);
        assert_eq!(p.segment_size(MIB), 2 * MIB);
        assert_eq!(p.segment_size(MIB + 512), 20 * MIB);
        assert_eq!(p.segment_size(10 * MIB - 512), 20 * MIB);
        assert_eq!(p.segment_size(10 * MIB), 10 * MIB);
        assert_eq!(p.segment_size(10 * MIB + 512), 12 * MIB);
        assert_eq!(p.segment_size(154_389_504), 155_189_248);
        assert!(is_small(MIB) && !is_small(MIB + 512));
    }

    #[test]
    fn split_rules_match_pytorch() {
        let mut p = SizePolicy::default();
        // Small pool: split when at least 512 B remain.
        assert!(p.should_split(2 * MIB, 2 * MIB - 512, true, false));
        assert!(!p.should_split(1024, 1024, true, false));
        // Large pool: split only if more than 1 MiB remains.
        assert!(!p.should_split(20 * MIB, 19 * MIB, false, false));
        assert!(p.should_split(20 * MIB, 19 * MIB - 512, false, false));
        // vmm splits like expandable segments.
        assert!(p.should_split(20 * MIB, 19 * MIB, false, true));
        // max_split_size: oversize requests are never split.
        p.max_split_size = 40 * MIB;
        assert!(!p.should_split(100 * MIB, 40 * MIB, false, false));
        assert!(p.should_split(100 * MIB, 30 * MIB, false, false));
    }

    #[test]
    fn oversize_rules_match_pytorch() {
        let mut p = SizePolicy::default();
        assert!(p.may_serve(1 << 40, MIB));
        p.max_split_size = 40 * MIB;
        // A small request may not take an oversize block.
        assert!(!p.may_serve(40 * MIB, 2 * MIB));
        assert!(p.may_serve(39 * MIB, 2 * MIB));
        // An oversize request takes an oversize block only within max_non_split_rounding.
        assert!(p.may_serve(59 * MIB, 40 * MIB));
        assert!(!p.may_serve(60 * MIB, 40 * MIB));
        assert!(p.is_oversize(40 * MIB) && !p.is_oversize(40 * MIB - 1));
    }
}
