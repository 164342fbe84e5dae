//! A slab whose ids can be pinned: while a checkpoint journal is open, ids are never reused, so
//! an undo entry can put a block back under exactly the id that links and the pointer map use.

/// `Vec<Option<T>>` plus a stack of vacant ids (entries may be stale: popping skips occupied
/// ids).
#[derive(Clone, Debug)]
pub struct IdSlab<T> {
    slots: Vec<Option<T>>,
    vacant: Vec<usize>,
    len: usize,
    /// When false, new entries always get fresh ids.
    pub reuse: bool,
}

impl<T> Default for IdSlab<T> {
    fn default() -> Self {
        IdSlab {
            slots: Vec::new(),
            vacant: Vec::new(),
            len: 0,
            reuse: true,
        }
    }
}

impl<T> IdSlab<T> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn insert(&mut self, v: T) -> usize {
        if self.reuse {
            while let Some(id) = self.vacant.pop() {
                if self.slots[id].is_none() {
                    self.slots[id] = Some(v);
                    self.len += 1;
                    return id;
                }
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
        self.vacant.push(id);
        v
    }

    pub fn take(&mut self, id: usize) -> Option<T> {
        let v = self.slots.get_mut(id)?.take()?;
        self.len -= 1;
        self.vacant.push(id);
        Some(v)
    }

    pub fn get(&self, id: usize) -> Option<&T> {
        self.slots.get(id)?.as_ref()
    }

    pub fn get_mut(&mut self, id: usize) -> Option<&mut T> {
        self.slots.get_mut(id)?.as_mut()
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
