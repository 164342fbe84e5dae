//! The operations of a random C ABI sequence and their proptest strategies. Indices (`pick`) are
//! taken modulo the length of what they pick from when the step runs, so shrinking a sequence
//! keeps every step meaningful.

use proptest::prelude::*;

/// Pools of device 0 the sequence allocates from, checkpoints and routes to.
pub const POOLS: usize = 3;
/// Streams used: the legacy default stream and three others.
pub const STREAMS: [u64; 4] = [0, 7, 9, 11];

/// One valid call (valid when the step runs, or skipped) or one bad call.
#[derive(Clone, Debug)]
pub enum Op {
    Alloc {
        dev: u8,
        size: usize,
        stream: u8,
    },
    PoolAlloc {
        pool: u8,
        size: usize,
        stream: u8,
    },
    Free {
        pick: u16,
    },
    EmptyCache {
        all: bool,
    },
    PoolEmptyCache {
        pool: u8,
    },
    Take {
        pool: u8,
    },
    Restore {
        cp: u8,
        keep: u32,
    },
    CheckpointFree {
        cp: u8,
    },
    DeltaFree {
        pick: u8,
    },
    GroupCreate {
        pool: u8,
        count: u8,
    },
    Begin {
        g: u8,
        k: u8,
    },
    End {
        g: u8,
    },
    GroupFree {
        g: u8,
    },
    ArenaCreate,
    ArenaAlloc {
        a: u8,
        slot: u8,
        size: usize,
    },
    ArenaFree {
        a: u8,
        slot: u8,
    },
    ArenaDestroy {
        a: u8,
    },
    Route {
        pool: u8,
        stream: u8,
        all: bool,
    },
    Unroute {
        pool: u8,
    },
    Incref {
        pool: u8,
    },
    Release {
        pool: u8,
    },
    ResetPeaks,
    /// Device `dev`'s memory limit set `headroom` bytes above what it reserves (`None`: lifted).
    Limit {
        dev: u8,
        headroom: Option<u32>,
    },
    /// A pool's limit set `headroom` bytes above what it reserves (`None`: lifted).
    PoolLimit {
        pool: u8,
        headroom: Option<u32>,
    },
    /// `sp_snapshot_take`, with the recorded history or not.
    SnapshotTake {
        traces: bool,
    },
    /// `sp_snapshot_free` of a live snapshot handle.
    SnapshotFree {
        pick: u8,
    },
    Bad(Bad),
}

/// A call that must be refused with its documented code and change nothing.
#[derive(Clone, Debug)]
pub enum Bad {
    /// `sp_free` of a pointer freed earlier.
    FreeFreed {
        pick: u16,
    },
    /// `sp_free` of a pointer inside a live allocation.
    FreeInterior {
        pick: u16,
    },
    FreeNull,
    /// `sp_free` of an address slotpool never handed out.
    FreeRandom {
        addr: u64,
    },
    /// A live handle of one kind passed to call `call` of another kind.
    WrongKind {
        kind: u8,
        pick: u8,
        call: u8,
    },
    /// A freed handle passed to call `call` of its own kind.
    Stale {
        pick: u8,
        call: u8,
    },
    /// A value that was never a handle.
    MadeUp {
        value: u64,
        call: u8,
    },
    /// `sp_checkpoint_restore` with `n_keep` = 2^`log`.
    HugeKeep {
        cp: u8,
        log: u8,
    },
    /// `sp_pool_verify_live` with `n` = 2^`log`.
    HugeVerify {
        pool: u8,
        log: u8,
    },
    /// A keep-live pointer the checkpoint lacks.
    KeepNotInCheckpoint {
        cp: u8,
        pick: u16,
    },
    /// A snapshot reader with an index out of range or a NULL out-pointer.
    SnapshotOutOfRange {
        pick: u8,
        what: u8,
    },
    /// `sp_pool_live_allocations` / `sp_pool_options_get` with a NULL out-pointer or an
    /// unknown pool.
    PoolReaderRefused {
        pool: u8,
        what: u8,
    },
    /// `sp_pool_verify_live` with one live allocation left out.
    VerifyWrong {
        pool: u8,
    },
    AllocSize {
        zero: bool,
    },
    AllocDevice {
        dev: i32,
    },
    PoolAllocUnknown {
        b: u64,
    },
    ArenaUnknown {
        id: u64,
    },
    ArenaAllocLive {
        a: u8,
        slot: u8,
    },
    ArenaFreeNotLive {
        a: u8,
        slot: u8,
    },
    ArenaDestroyLive {
        a: u8,
    },
    BeginActive {
        g: u8,
    },
    BeginOutOfRange {
        g: u8,
        k: u8,
    },
    EndInactive {
        g: u8,
    },
    UnrouteNone,
    ReleaseUnknown {
        b: u64,
    },
    ReleaseDefault,
    RouteTwice {
        pool: u8,
    },
    SimUnmapped {
        addr: u64,
    },
    SimHuge {
        pick: u16,
    },
}

fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        10 => 1usize..4096,
        8 => 4096usize..262_144,
        2 => (1usize << 20)..(6 << 20),
        // Large: a few of them reach the device's memory (model::CAPACITY).
        2 => (24usize << 20)..(160 << 20),
    ]
}

/// Headroom of a limit: tight, within a few pages, or lifted.
fn headroom() -> impl Strategy<Value = Option<u32>> {
    prop_oneof![
        3 => (0u32..(24 << 20)).prop_map(Some),
        1 => Just(None),
    ]
}

fn bad() -> impl Strategy<Value = Bad> {
    prop_oneof![
        any::<u16>().prop_map(|pick| Bad::FreeFreed { pick }),
        any::<u16>().prop_map(|pick| Bad::FreeInterior { pick }),
        Just(Bad::FreeNull),
        any::<u64>().prop_map(|addr| Bad::FreeRandom { addr }),
        (0u8..4, any::<u8>(), any::<u8>()).prop_map(|(kind, pick, call)| Bad::WrongKind {
            kind,
            pick,
            call
        }),
        (any::<u8>(), any::<u8>()).prop_map(|(pick, call)| Bad::Stale { pick, call }),
        (any::<u64>(), any::<u8>()).prop_map(|(value, call)| Bad::MadeUp { value, call }),
        (any::<u8>(), 24u8..64).prop_map(|(cp, log)| Bad::HugeKeep { cp, log }),
        (any::<u8>(), 24u8..64).prop_map(|(pool, log)| Bad::HugeVerify { pool, log }),
        (any::<u8>(), any::<u16>()).prop_map(|(cp, pick)| Bad::KeepNotInCheckpoint { cp, pick }),
        (any::<u8>(), any::<u8>()).prop_map(|(pick, what)| Bad::SnapshotOutOfRange { pick, what }),
        (any::<u8>(), any::<u8>()).prop_map(|(pool, what)| Bad::PoolReaderRefused { pool, what }),
        any::<u8>().prop_map(|pool| Bad::VerifyWrong { pool }),
        any::<bool>().prop_map(|zero| Bad::AllocSize { zero }),
        prop_oneof![Just(-2i32), Just(2), Just(64), Just(i32::MIN)]
            .prop_map(|dev| Bad::AllocDevice { dev }),
        (1u64 << 40..1 << 41).prop_map(|b| Bad::PoolAllocUnknown { b }),
        (1u64 << 40..u64::MAX).prop_map(|id| Bad::ArenaUnknown { id }),
        (any::<u8>(), any::<u8>()).prop_map(|(a, slot)| Bad::ArenaAllocLive { a, slot }),
        (any::<u8>(), any::<u8>()).prop_map(|(a, slot)| Bad::ArenaFreeNotLive { a, slot }),
        any::<u8>().prop_map(|a| Bad::ArenaDestroyLive { a }),
        any::<u8>().prop_map(|g| Bad::BeginActive { g }),
        (any::<u8>(), any::<u8>()).prop_map(|(g, k)| Bad::BeginOutOfRange { g, k }),
        any::<u8>().prop_map(|g| Bad::EndInactive { g }),
        Just(Bad::UnrouteNone),
        (1u64 << 40..1 << 41).prop_map(|b| Bad::ReleaseUnknown { b }),
        Just(Bad::ReleaseDefault),
        any::<u8>().prop_map(|pool| Bad::RouteTwice { pool }),
        (1u64..1 << 40).prop_map(|addr| Bad::SimUnmapped { addr }),
        any::<u16>().prop_map(|pick| Bad::SimHuge { pick }),
    ]
}

/// One step: mostly valid calls, one in five a bad one.
pub fn op() -> impl Strategy<Value = Op> {
    let pool = 0u8..POOLS as u8;
    let stream = 0u8..STREAMS.len() as u8;
    prop_oneof![
        8 => (0u8..2, size(), stream.clone())
            .prop_map(|(dev, size, stream)| Op::Alloc { dev, size, stream }),
        8 => (pool.clone(), size(), stream.clone())
            .prop_map(|(pool, size, stream)| Op::PoolAlloc { pool, size, stream }),
        10 => any::<u16>().prop_map(|pick| Op::Free { pick }),
        1 => any::<bool>().prop_map(|all| Op::EmptyCache { all }),
        1 => pool.clone().prop_map(|pool| Op::PoolEmptyCache { pool }),
        2 => pool.clone().prop_map(|pool| Op::Take { pool }),
        3 => (any::<u8>(), any::<u32>()).prop_map(|(cp, keep)| Op::Restore { cp, keep }),
        1 => any::<u8>().prop_map(|cp| Op::CheckpointFree { cp }),
        1 => any::<u8>().prop_map(|pick| Op::DeltaFree { pick }),
        1 => (pool.clone(), 1u8..4).prop_map(|(pool, count)| Op::GroupCreate { pool, count }),
        2 => (any::<u8>(), any::<u8>()).prop_map(|(g, k)| Op::Begin { g, k }),
        2 => any::<u8>().prop_map(|g| Op::End { g }),
        1 => any::<u8>().prop_map(|g| Op::GroupFree { g }),
        1 => Just(Op::ArenaCreate),
        3 => (any::<u8>(), 0u8..6, size())
            .prop_map(|(a, slot, size)| Op::ArenaAlloc { a, slot, size }),
        2 => (any::<u8>(), 0u8..6).prop_map(|(a, slot)| Op::ArenaFree { a, slot }),
        1 => any::<u8>().prop_map(|a| Op::ArenaDestroy { a }),
        1 => (pool.clone(), stream, any::<bool>())
            .prop_map(|(pool, stream, all)| Op::Route { pool, stream, all }),
        1 => pool.clone().prop_map(|pool| Op::Unroute { pool }),
        1 => pool.clone().prop_map(|pool| Op::Incref { pool }),
        1 => pool.prop_map(|pool| Op::Release { pool }),
        1 => Just(Op::ResetPeaks),
        2 => (0u8..2, headroom()).prop_map(|(dev, headroom)| Op::Limit { dev, headroom }),
        2 => (0u8..POOLS as u8, headroom())
            .prop_map(|(pool, headroom)| Op::PoolLimit { pool, headroom }),
        1 => any::<bool>().prop_map(|traces| Op::SnapshotTake { traces }),
        1 => any::<u8>().prop_map(|pick| Op::SnapshotFree { pick }),
        12 => bad().prop_map(Op::Bad),
    ]
}
