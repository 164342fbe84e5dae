//! A stable radix sort over integer keys: restores and the live map's journal replay sort
//! thousands of addresses at a time, where a comparison sort costs several times more.

/// Sort `v` by `key`, which must fit in `bits` bits, keeping the order of equal keys; `tmp` is
/// a buffer. A restore sorts thousands of addresses, and this radix sort costs a fraction of a
/// comparison sort.
pub(crate) fn radix_sort<T: Copy>(
    v: &mut Vec<T>,
    tmp: &mut Vec<T>,
    bits: u32,
    key: impl Fn(&T) -> u64,
) {
    const MAX_DIGIT: u32 = 11;
    if v.len() < 256 {
        v.sort_by_key(|x| key(x));
        return;
    }
    let passes = bits.div_ceil(MAX_DIGIT).max(1);
    let digit = bits.div_ceil(passes).max(1);
    let mask = (1u64 << digit) - 1;
    let mut counts = vec![0u32; (passes as usize) << digit];
    for x in v.iter() {
        let k = key(x);
        for p in 0..passes {
            counts[((p as usize) << digit) + ((k >> (p * digit)) & mask) as usize] += 1;
        }
    }
    // Every pass writes all of `tmp`: it only needs the length (kept from the last restore,
    // a copy of `v` cost as much as a pass).
    if tmp.len() < v.len() {
        tmp.resize(v.len(), v[0]);
    }
    tmp.truncate(v.len());
    for (p, c) in counts.chunks_exact_mut(1 << digit).enumerate() {
        // A digit that is the same everywhere leaves the order as it is.
        if c.iter().any(|&n| n as usize == v.len()) {
            continue;
        }
        let mut sum = 0;
        for n in c.iter_mut() {
            let here = *n;
            *n = sum;
            sum += here;
        }
        let shift = p as u32 * digit;
        for x in v.iter() {
            let d = ((key(x) >> shift) & mask) as usize;
            tmp[c[d] as usize] = *x;
            c[d] += 1;
        }
        std::mem::swap(v, tmp);
    }
}

/// Bits needed for `x`.
pub(crate) fn bits(x: u64) -> u32 {
    64 - x.leading_zeros()
}
