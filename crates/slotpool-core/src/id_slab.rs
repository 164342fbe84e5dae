//! A slab of segments: ids stay put while other entries come and go.

/// `Vec<Option<T>>` plus a stack of vacant ids.
#[derive(Clone, Debug)]
pub struct IdSlab<T> {
    slots: Vec<Option<T>>,
    vacant: Vec<usize>,
    len: usize,
}

impl<T> Default for IdSlab<T> {
    fn default() -> Self {
        IdSlab {
            slots: Vec::new(),
            vacant: Vec::new(),
            len: 0,
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

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn insert(&mut self, v: T) -> usize {
        if let Some(id) = self.vacant.pop() {
            self.slots[id] = Some(v);
            self.len += 1;
            return id;
        }
        self.slots.push(Some(v));
        self.len += 1;
        self.slots.len() - 1
    }

    pub fn remove(&mut self, id: usize) -> T {
        let v = self.slots[id].take().expect("remove of a vacant slot");
        self.len -= 1;
        self.vacant.push(id);
        v
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

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (usize, &mut T)> {
        self.slots
            .iter_mut()
            .enumerate()
            .filter_map(|(i, v)| v.as_mut().map(|v| (i, v)))
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
