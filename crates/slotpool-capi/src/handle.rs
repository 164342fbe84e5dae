//! Handles: the values behind `sp_checkpoint*`, `sp_restore_delta*`, `sp_variant_group*` and
//! `sp_snapshot*`.
//!
//! A handle is a token, not an address. Its 64 bits are the kind's tag (bits 56..64), the
//! generation of its slot (bits 24..56) and the slot (bits 0..24) in the kind's own [`Registry`].
//! So a handle of one kind passed where another is expected, a freed handle (even once its slot
//! holds a new object) and a made-up value are all refused by looking at the registry alone,
//! never by reading through the value. Every tag has its top bit set, so a token is never NULL
//! and is never a valid user-space address: a C program that dereferences one faults at once.
//!
//! A slot's generation grows by one when its object is freed; a slot whose generation would wrap
//! is retired for good, so a freed handle is never accepted again. A lookup hands out an [`Arc`]:
//! a call that found its object keeps it alive even if another thread frees the handle meanwhile.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::error::{Error, Result};

/// The kinds of handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Checkpoint,
    Delta,
    VariantGroup,
    Snapshot,
}

const KINDS: [Kind; 4] = [
    Kind::Checkpoint,
    Kind::Delta,
    Kind::VariantGroup,
    Kind::Snapshot,
];

impl Kind {
    /// The tag byte in bits 56..64 of this kind's tokens.
    const fn tag(self) -> u64 {
        match self {
            Kind::Checkpoint => 0xC1,
            Kind::Delta => 0xD2,
            Kind::VariantGroup => 0xE3,
            Kind::Snapshot => 0xF4,
        }
    }

    /// The kind's name in messages.
    pub(crate) const fn name(self) -> &'static str {
        match self {
            Kind::Checkpoint => "checkpoint",
            Kind::Delta => "restore delta",
            Kind::VariantGroup => "variant group",
            Kind::Snapshot => "snapshot",
        }
    }
}

const TAG_SHIFT: u32 = 56;
const GEN_SHIFT: u32 = 24;
/// Slots per kind: 2^24 handles of one kind may be live at once.
const SLOTS: usize = 1 << GEN_SHIFT;

fn token(kind: Kind, generation: u32, slot: usize) -> u64 {
    (kind.tag() << TAG_SHIFT) | (u64::from(generation) << GEN_SHIFT) | slot as u64
}

/// The token of a handle pointer.
pub(crate) fn token_of<T>(p: *const T) -> u64 {
    p.addr() as u64
}

/// The handle pointer of a token.
pub(crate) fn pointer_of<T>(t: u64) -> *mut T {
    std::ptr::without_provenance_mut(t as usize)
}

/// One slot: its generation, and its object while live.
struct Entry<T> {
    generation: u32,
    value: Option<Arc<T>>,
}

struct Slots<T> {
    entries: Vec<Entry<T>>,
    /// Free slots, reused last-freed first.
    vacant: Vec<usize>,
}

/// The live handles of one kind.
pub(crate) struct Registry<T> {
    kind: Kind,
    slots: Mutex<Slots<T>>,
}

impl<T> Registry<T> {
    pub(crate) const fn new(kind: Kind) -> Self {
        Registry {
            kind,
            slots: Mutex::new(Slots {
                entries: Vec::new(),
                vacant: Vec::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Slots<T>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers `value`; returns its token.
    pub(crate) fn insert(&self, value: T) -> Result<u64> {
        let mut s = self.lock();
        let slot = match s.vacant.pop() {
            Some(slot) => slot,
            None if s.entries.len() < SLOTS => {
                s.entries.push(Entry {
                    generation: 0,
                    value: None,
                });
                s.entries.len() - 1
            }
            None => {
                return Err(Error::OutOfMemory(format!(
                    "{SLOTS} {} handles are live: free some first",
                    self.kind.name()
                )));
            }
        };
        let e = &mut s.entries[slot];
        e.value = Some(Arc::new(value));
        Ok(token(self.kind, e.generation, slot))
    }

    /// Why `t` is not a live handle of this kind, or its slot.
    fn check(&self, s: &Slots<T>, t: u64, what: &str) -> Result<usize> {
        let own = self.kind.name();
        let tag = t >> TAG_SHIFT;
        if tag != self.kind.tag() {
            return Err(Error::InvalidArgument(
                match KINDS.iter().find(|k| k.tag() == tag) {
                    Some(other) => {
                        format!("{what} {t:#x} is a {} handle, not a {own}", other.name())
                    }
                    None => {
                        format!("{what} {t:#x} is not a {own} handle: never returned by slotpool")
                    }
                },
            ));
        }
        let generation = ((t >> GEN_SHIFT) & u64::from(u32::MAX)) as u32;
        let slot = (t & (SLOTS as u64 - 1)) as usize;
        match s.entries.get(slot) {
            Some(e) if e.generation == generation && e.value.is_some() => Ok(slot),
            Some(e) if generation < e.generation => Err(Error::InvalidArgument(format!(
                "{what} {t:#x} is a {own} handle that was freed"
            ))),
            _ => Err(Error::InvalidArgument(format!(
                "{what} {t:#x} is not a {own} handle: never returned by slotpool"
            ))),
        }
    }

    /// The object of the live handle `p`.
    pub(crate) fn get_ptr<P>(&self, p: *const P) -> Result<Arc<T>> {
        self.get(token_of(p), self.kind.name())
    }

    /// The object of the live handle `t`.
    pub(crate) fn get(&self, t: u64, what: &str) -> Result<Arc<T>> {
        if t == 0 {
            return Err(Error::null(what));
        }
        let s = self.lock();
        let slot = self.check(&s, t, what)?;
        Ok(Arc::clone(
            s.entries[slot].value.as_ref().expect("checked live"),
        ))
    }

    /// Unregisters the live handle `t` (0 is accepted and does nothing); its object is dropped
    /// once no call still uses it.
    pub(crate) fn remove(&self, t: u64, what: &str) -> Result<()> {
        // Dropped outside the lock: dropping a checkpoint takes allocator locks.
        drop(self.take(t, what)?);
        Ok(())
    }

    /// Unregisters the live handle `t` (0 is accepted: `None`) and hands its object back.
    pub(crate) fn take(&self, t: u64, what: &str) -> Result<Option<Arc<T>>> {
        if t == 0 {
            return Ok(None);
        }
        let value = {
            let mut s = self.lock();
            let slot = self.check(&s, t, what)?;
            let e = &mut s.entries[slot];
            let value = e.value.take();
            e.generation = e.generation.wrapping_add(1);
            // A generation that wrapped would make old tokens valid again: retire the slot.
            if e.generation != 0 {
                s.vacant.push(slot);
            }
            value
        };
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_carry_kind_generation_and_slot() {
        let r = Registry::new(Kind::Delta);
        let a = r.insert(1).unwrap();
        assert_eq!(a >> TAG_SHIFT, Kind::Delta.tag());
        assert!(a >> 63 == 1, "never a user-space address");
        assert_eq!(*r.get(a, "d").unwrap(), 1);
        r.remove(a, "d").unwrap();
        let b = r.insert(2).unwrap();
        assert_ne!(a, b, "the slot is reused under a new generation");
        assert_eq!(a & (SLOTS as u64 - 1), b & (SLOTS as u64 - 1));
        let e = r.get(a, "d").unwrap_err();
        assert!(e.to_string().contains("was freed"), "{e}");
        assert!(r.remove(a, "d").is_err());
        assert_eq!(*r.get(b, "d").unwrap(), 2);
        let other = Registry::<i32>::new(Kind::Checkpoint);
        let e = other.get(b, "cp").unwrap_err();
        assert!(
            e.to_string()
                .contains("restore delta handle, not a checkpoint"),
            "{e}"
        );
        assert!(
            r.get(b + (1 << GEN_SHIFT), "d").is_err(),
            "a future generation"
        );
        assert!(r.get(b + 1, "d").is_err(), "a slot never used");
        assert!(r.get(0x1234, "d").is_err());
        assert!(matches!(r.get(0, "d"), Err(Error::InvalidArgument(m)) if m.contains("NULL")));
        assert!(r.remove(0, "d").is_ok());
    }

    #[test]
    fn a_slot_whose_generation_would_wrap_is_retired() {
        let r = Registry::new(Kind::Checkpoint);
        let t = r.insert(0).unwrap();
        r.lock().entries[0].generation = u32::MAX;
        let last = token(Kind::Checkpoint, u32::MAX, 0);
        r.remove(last, "cp").unwrap();
        assert!(r.lock().vacant.is_empty());
        let next = r.insert(1).unwrap();
        assert_ne!(next & (SLOTS as u64 - 1), 0, "a new slot");
        assert!(r.get(t, "cp").is_err(), "generation 0 of slot 0 stays dead");
    }

    #[test]
    fn a_use_outlives_a_concurrent_free() {
        let r = Registry::new(Kind::VariantGroup);
        let t = r.insert(vec![7u8; 16]).unwrap();
        let held = r.get(t, "g").unwrap();
        r.remove(t, "g").unwrap();
        assert_eq!(held[3], 7);
        assert_eq!(Arc::strong_count(&held), 1);
    }
}
