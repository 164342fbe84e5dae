//! A slab whose ids can be held back: while a checkpoint journal is open, an id that a journal
//! entry names is not reused, so an undo entry can put a block back under exactly the id that
//! links and the pointer map use.

/// `Vec<Option<T>>` plus a stack of vacant ids (entries may be stale: popping skips occupied
/// ids). While `hold` is on, freed ids go to `held` instead: the journal names them.
#[derive(Clone, Debug)]
pub struct IdSlab<T> {
    slots: Vec<Option<T>>,
    vacant: Vec<usize>,
    held: Vec<usize>,
    /// Held ids made reusable again (`unhold`), until the next mark (`seal`).
    reusable: Vec<usize>,
    len: usize,
    hold: bool,
}

impl<T> Default for IdSlab<T> {
    fn default() -> Self {
        IdSlab {
            slots: Vec::new(),
            vacant: Vec::new(),
            held: Vec::new(),
            reusable: Vec::new(),
            len: 0,
            hold: false,
        }
    }
}

impl<T> IdSlab<T> {
    /// A slab with room for `n` entries and `n` vacant ids before it reallocates.
    pub fn with_capacity(n: usize) -> Self {
        IdSlab {
            slots: Vec::with_capacity(n),
            vacant: Vec::with_capacity(n),
            ..Self::default()
        }
    }

    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Entries the slab holds before it reallocates.
    pub fn capacity(&self) -> usize {
        self.slots.capacity()
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// While on, freed ids are held back instead of reused; turning it off releases them all.
    pub fn set_hold(&mut self, on: bool) {
        if !on {
            self.vacant.append(&mut self.held);
            self.vacant.append(&mut self.reusable);
        }
        self.hold = on;
    }

    /// Release the held ids that are vacant and not `named` (by a journal entry) for reuse;
    /// forget those occupied again (a restore put a block back under them).
    pub fn release_held(&mut self, named: impl Fn(usize) -> bool) {
        let slots = &self.slots;
        let vacant = &mut self.vacant;
        self.held.retain(|&id| {
            if slots[id].is_some() {
                return false;
            }
            if named(id) {
                return true;
            }
            vacant.push(id);
            false
        });
    }

    /// Make `id`, just removed while ids are held, reusable after all: no journal entry needs it
    /// kept vacant.
    pub fn unhold(&mut self, id: usize) {
        if self.held.last() == Some(&id) {
            self.held.pop();
            self.reusable.push(id);
        }
    }

    /// A new mark: ids made reusable so far are held like the others (entries before the mark
    /// name them).
    pub fn seal(&mut self) {
        self.held.append(&mut self.reusable);
    }

    pub fn insert(&mut self, v: T) -> usize {
        while let Some(id) = self.reusable.pop() {
            if self.slots[id].is_none() {
                self.slots[id] = Some(v);
                self.len += 1;
                return id;
            }
        }
        while let Some(id) = self.vacant.pop() {
            if self.slots[id].is_none() {
                self.slots[id] = Some(v);
                self.len += 1;
                return id;
            }
        }
        self.slots.push(Some(v));
        self.len += 1;
        self.slots.len() - 1
    }

    /// Put `v` under `id`, which must be vacant (undo of a removal).
    pub fn put(&mut self, id: usize, v: T) {
        if id >= self.slots.len() {
            self.slots.resize_with(id + 1, || None);
        }
        debug_assert!(self.slots[id].is_none(), "slot {id} is occupied");
        if self.slots[id].is_none() {
            self.len += 1;
        }
        self.slots[id] = Some(v);
    }

    pub fn remove(&mut self, id: usize) -> T {
        let v = self.slots[id].take().expect("remove of a vacant slot");
        self.len -= 1;
        self.vacate(id);
        v
    }

    pub fn take(&mut self, id: usize) -> Option<T> {
        let v = self.slots.get_mut(id)?.take()?;
        self.len -= 1;
        self.vacate(id);
        Some(v)
    }

    fn vacate(&mut self, id: usize) {
        if self.hold {
            self.held.push(id);
        } else {
            self.vacant.push(id);
        }
    }

    /// Slots, vacant or not (the slab's memory grows with this).
    pub fn capacity_ids(&self) -> usize {
        self.slots.len()
    }

    pub fn get(&self, id: usize) -> Option<&T> {
        self.slots.get(id)?.as_ref()
    }

    pub fn get_mut(&mut self, id: usize) -> Option<&mut T> {
        self.slots.get_mut(id)?.as_mut()
    }

    /// `self[id]`, inlined: for the quick cache's round trip only (inlining `Index` everywhere
    /// made the large-block paths longer).
    #[inline(always)]
    pub(crate) fn hot(&self, id: usize) -> &T {
        self.slots[id].as_ref().expect("vacant slot")
    }

    /// `&mut self[id]`, inlined: see [`IdSlab::hot`].
    #[inline(always)]
    pub(crate) fn hot_mut(&mut self, id: usize) -> &mut T {
        self.slots[id].as_mut().expect("vacant slot")
    }

    pub fn contains(&self, id: usize) -> bool {
        self.get(id).is_some()
    }

    pub fn iter(&self) -> impl Iterator<Item = (usize, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, v)| v.as_ref().map(|v| (i, v)))
    }
}

impl<T> std::ops::Index<usize> for IdSlab<T> {
    type Output = T;
    fn index(&self, id: usize) -> &T {
        self.slots[id].as_ref().expect("vacant slot")
    }
}

impl<T> std::ops::IndexMut<usize> for IdSlab<T> {
    fn index_mut(&mut self, id: usize) -> &mut T {
        self.slots[id].as_mut().expect("vacant slot")
    }
}
