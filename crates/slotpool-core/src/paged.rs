//! `Paged<T, P>`: a vector kept in pages of `P` elements that journals itself page by page, and
//! `Logged<T>`: one value that journals itself whole; the copy-on-write storage under the free
//! index (see "Checkpoint / restore" in `docs/design.md`).
//!
//! While a mark is open, the first change to a page in a *window* moves the page into the log
//! and carries on in a copy. Restoring a mark moves the logged pages back: it costs a pointer per
//! page changed since the mark, never a copy of their elements. A mark or a restore opens a new
//! window; with no mark open nothing is logged and a change costs one comparison more than in a
//! plain `Vec`.
//!
//! The marks themselves belong to the caller (a shard keeps one [`PagedMark`] per structure in
//! each checkpoint mark) and are passed back to [`Paged::restore`] and [`Paged::forget_before`].

/// A mark's place in a [`Paged`]'s log, and the vector's length then.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PagedMark {
    /// Log position counted from the first entry ever logged: dropping entries in front
    /// ([`Paged::forget_before`]) does not move it.
    pos: u64,
    len: usize,
}

/// The log and the window clock that [`Paged`] and [`Logged`] share.
#[derive(Clone, Debug)]
struct Log<E> {
    entries: Vec<E>,
    /// Position of `entries[0]` (see [`PagedMark::pos`]).
    base: u64,
    /// The window changes are logged in; 0 while no mark is open (nothing is logged).
    window: u64,
    /// The last window opened (windows are never reused, so an old stamp never matches).
    opened: u64,
}

impl<E> Default for Log<E> {
    fn default() -> Self {
        Log {
            entries: Vec::new(),
            base: 0,
            window: 0,
            opened: 0,
        }
    }
}

impl<E> Log<E> {
    /// Whether something last logged in window `stamp` must be logged before it changes.
    #[inline]
    fn due(&self, stamp: u64) -> bool {
        self.window != 0 && stamp != self.window
    }

    /// [`Log::due`] for page `p` of `stamps`, its stamp read only while a window is open:
    /// outside one (no mark, the hot paths' usual case) a change costs one load and no bounds
    /// check.
    #[inline(always)]
    fn due_page(&self, stamps: &[u64], p: usize) -> bool {
        self.window != 0 && self.due(stamps[p])
    }

    fn open_window(&mut self) {
        self.opened += 1;
        self.window = self.opened;
    }

    /// A mark here, of a structure of `len` elements; opens a window.
    fn mark(&mut self, len: usize) -> PagedMark {
        self.open_window();
        PagedMark {
            pos: self.base + self.entries.len() as u64,
            len,
        }
    }

    /// Entries logged since `m`, as an index into `entries`.
    fn start(&self, m: PagedMark) -> usize {
        let start = m.pos.checked_sub(self.base).expect("a forgotten mark");
        usize::try_from(start)
            .expect("log position")
            .min(self.entries.len())
    }

    fn forget_before(&mut self, m: PagedMark) {
        let n = self.start(m);
        self.entries.drain(..n);
        self.base += n as u64;
    }

    fn forget_all(&mut self) {
        self.base += self.entries.len() as u64;
        self.entries.clear();
        self.window = 0;
    }

    /// Its own consistency: `stamps` never name a window not opened yet.
    fn check(&self, stamps: &[u64]) -> Result<(), String> {
        if self.window > self.opened || stamps.iter().any(|&s| s > self.opened) {
            return Err("stamped with a window never opened".into());
        }
        Ok(())
    }
}

/// See the module documentation.
///
/// Invariants (checked by [`Paged::check`]): `pages` holds exactly `len.div_ceil(P)` pages and
/// `stamp` one window per page; no page is stamped with a window that has not been opened.
#[derive(Clone, Debug)]
pub(crate) struct Paged<T, const P: usize> {
    pages: Vec<Box<[T; P]>>,
    len: usize,
    /// Per page, the window in which it was last logged (or made).
    stamp: Vec<u64>,
    /// Pages as they were before their first change in some window: (page, image).
    log: Log<(usize, Box<[T; P]>)>,
    /// Pages a restore replaced, kept for the next copies: dropping them read every element
    /// of pages long out of the cache (a third of a restore of the block slab), and each copy
    /// cost an allocation.
    spare: Vec<Box<[T; P]>>,
}

impl<T: Clone + Default, const P: usize> Default for Paged<T, P> {
    fn default() -> Self {
        Paged {
            pages: Vec::new(),
            len: 0,
            stamp: Vec::new(),
            log: Log::default(),
            spare: Vec::new(),
        }
    }
}

fn blank<T: Default, const P: usize>() -> Box<[T; P]> {
    Box::new(std::array::from_fn(|_| T::default()))
}

/// A copy of `page`, in one of the `spare` pages when there is one (no allocation).
fn copy_of<T: Clone, const P: usize>(spare: &mut Vec<Box<[T; P]>>, page: &[T; P]) -> Box<[T; P]> {
    match spare.pop() {
        Some(mut copy) => {
            copy.clone_from_slice(&page[..]);
            copy
        }
        None => Box::new(page.clone()),
    }
}

impl<T: Clone + Default, const P: usize> Paged<T, P> {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Room for `pages` pages before the page table reallocates.
    pub(crate) fn reserve_pages(&mut self, pages: usize) {
        self.pages.reserve(pages);
        self.stamp.reserve(pages);
    }

    /// Elements the page table has room for before it reallocates.
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.pages.capacity() * P
    }

    #[inline]
    pub(crate) fn get(&self, i: usize) -> Option<&T> {
        if i >= self.len {
            return None;
        }
        Some(&self.pages[i / P][i % P])
    }

    /// Element `i` of a page in use, which may lie past the length (stale or default there):
    /// one bounds check instead of two, for callers whose indexes are always in range.
    ///
    /// Panics if `i` is past the last page.
    #[inline]
    pub(crate) fn at(&self, i: usize) -> &T {
        &self.pages[i / P][i % P]
    }

    /// [`Paged::at`], for a change (logged first as in [`Paged::get_mut`]).
    #[inline(always)]
    pub(crate) fn at_mut(&mut self, i: usize) -> &mut T {
        let p = i / P;
        if self.log.due_page(&self.stamp, p) {
            self.log_page(p);
        }
        &mut self.pages[p][i % P]
    }

    /// Element `i`, for a change: its page is logged first if a mark is open and the page was
    /// not logged in this window.
    #[inline]
    pub(crate) fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        if i >= self.len {
            return None;
        }
        let p = i / P;
        if self.log.due_page(&self.stamp, p) {
            self.log_page(p);
        }
        Some(&mut self.pages[p][i % P])
    }

    /// Move page `p` into the log and go on in a copy of it.
    #[cold]
    #[inline(never)]
    fn log_page(&mut self, p: usize) {
        let copy = copy_of(&mut self.spare, &self.pages[p]);
        let old = std::mem::replace(&mut self.pages[p], copy);
        self.log.entries.push((p, old));
        self.stamp[p] = self.log.window;
    }

    /// Append `v`; returns its index.
    pub(crate) fn push(&mut self, v: T) -> usize {
        let i = self.len;
        if i / P == self.pages.len() {
            // A page made now needs no image: a restore to any open mark cuts it away (its
            // length was shorter), and the stamp keeps it from being logged in this window.
            self.grow_pages(i / P + 1);
        }
        self.len += 1;
        *self.get_mut(i).expect("just pushed") = v;
        i
    }

    /// Elements in order.
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.pages.iter().flat_map(|p| p.iter()).take(self.len)
    }

    /// Open a mark: changes from now on are logged until [`Paged::forget_all`].
    pub(crate) fn mark(&mut self) -> PagedMark {
        self.log.mark(self.len)
    }

    fn grow_pages(&mut self, n: usize) {
        while self.pages.len() < n {
            self.pages.push(blank());
            self.stamp.push(self.log.window);
        }
    }

    /// Back to the state at `m`. With no later mark open (`journaled` false) the logged pages
    /// move back and the log is cut at `m`: the cost is a pointer per entry. With later marks
    /// open the restore is a change like any other, logged so that every later mark stays
    /// restorable, and each page it puts back is a copy of its image.
    pub(crate) fn restore(&mut self, m: PagedMark, journaled: bool) {
        let start = self.log.start(m);
        let pages = m.len.div_ceil(P);
        if journaled {
            // The first entry of a page from `start` on is its image at `m`.
            let mut first: Vec<usize> = Vec::new();
            let mut seen = vec![false; self.pages.len().max(pages)];
            for k in start..self.log.entries.len() {
                let p = self.log.entries[k].0;
                if p >= seen.len() {
                    seen.resize(p + 1, false);
                }
                if !std::mem::replace(&mut seen[p], true) {
                    first.push(k);
                }
            }
            // Pages past the mark's length: logged (later marks may have them), then cut away.
            for p in pages..self.pages.len() {
                if self.log.due_page(&self.stamp, p) {
                    self.log_page(p);
                }
            }
            self.pages.truncate(pages);
            self.stamp.truncate(pages);
            self.grow_pages(pages);
            // At most as many spare pages as pages, as below.
            let keep = self.pages.len();
            for k in first {
                let p = self.log.entries[k].0;
                if p >= pages {
                    continue;
                }
                // The page takes a copy of its image (in a spare page when there is one); what
                // it held goes to the log if this window has not logged it (the copy
                // `log_page` would make is overwritten at once), else to the spare pages.
                let copy = copy_of(&mut self.spare, &self.log.entries[k].1);
                let old = std::mem::replace(&mut self.pages[p], copy);
                if self.log.due_page(&self.stamp, p) {
                    self.log.entries.push((p, old));
                    self.stamp[p] = self.log.window;
                } else if self.spare.len() < keep {
                    self.spare.push(old);
                }
            }
        } else {
            // At most as many spare pages as pages: memory stays within twice the vector.
            let keep = self.pages.len().max(pages);
            let mut entries = std::mem::take(&mut self.log.entries);
            for (p, image) in entries.drain(start..).rev() {
                if p < pages {
                    if p >= self.pages.len() {
                        self.grow_pages(p + 1);
                    }
                    let old = std::mem::replace(&mut self.pages[p], image);
                    if self.spare.len() < keep {
                        self.spare.push(old);
                    }
                }
            }
            self.log.entries = entries;
            self.pages.truncate(pages);
            self.stamp.truncate(pages);
            self.grow_pages(pages);
            // Stamps of this window name entries just cut away.
            self.log.open_window();
        }
        self.len = m.len;
    }

    /// Whether changes are logged (a mark is open).
    #[inline]
    pub(crate) fn logging(&self) -> bool {
        self.log.window != 0
    }

    /// The oldest open mark is now `m`: entries logged before it are not needed any more.
    pub(crate) fn forget_before(&mut self, m: PagedMark) {
        self.log.forget_before(m);
    }

    /// No mark is open any more: the log goes, and changes are not logged.
    pub(crate) fn forget_all(&mut self) {
        self.log.forget_all();
    }

    /// Pages logged for the open marks.
    pub(crate) fn log_len(&self) -> usize {
        self.log.entries.len()
    }

    /// Its own consistency (see the type's invariants).
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.pages.len() != self.len.div_ceil(P) || self.stamp.len() != self.pages.len() {
            return Err(format!(
                "{} pages and {} stamps for {} elements",
                self.pages.len(),
                self.stamp.len(),
                self.len
            ));
        }
        self.log.check(&self.stamp)
    }
}

/// One value that journals itself whole, with [`Paged`]'s protocol: while a mark is open, the
/// first change in a window logs a copy of it. Kept inline (a [`Paged`] of one element would cost
/// a pointer chase on every read).
#[derive(Clone, Debug)]
pub(crate) struct Logged<T> {
    value: T,
    stamp: u64,
    log: Log<T>,
}

impl<T: Clone> Logged<T> {
    pub(crate) fn new(value: T) -> Self {
        Logged {
            value,
            stamp: 0,
            log: Log::default(),
        }
    }

    #[inline]
    pub(crate) fn get(&self) -> &T {
        &self.value
    }

    /// The value, for a change: logged first if a mark is open and it was not logged in this
    /// window.
    #[inline]
    pub(crate) fn get_mut(&mut self) -> &mut T {
        if self.log.due(self.stamp) {
            self.log_value();
        }
        &mut self.value
    }

    #[cold]
    #[inline(never)]
    fn log_value(&mut self) {
        self.log.entries.push(self.value.clone());
        self.stamp = self.log.window;
    }

    /// See [`Paged::mark`].
    pub(crate) fn mark(&mut self) -> PagedMark {
        self.log.mark(1)
    }

    /// See [`Paged::restore`]: the first value logged since `m` was the value at `m`.
    pub(crate) fn restore(&mut self, m: PagedMark, journaled: bool) {
        let start = self.log.start(m);
        if journaled {
            if start < self.log.entries.len() {
                if self.log.due(self.stamp) {
                    self.log_value();
                }
                self.value = self.log.entries[start].clone();
            }
        } else {
            if start < self.log.entries.len() {
                self.value = self.log.entries.swap_remove(start);
                self.log.entries.truncate(start);
            }
            self.log.open_window();
        }
    }

    /// See [`Paged::forget_before`].
    pub(crate) fn forget_before(&mut self, m: PagedMark) {
        self.log.forget_before(m);
    }

    /// See [`Paged::forget_all`].
    pub(crate) fn forget_all(&mut self) {
        self.log.forget_all();
    }

    pub(crate) fn log_len(&self) -> usize {
        self.log.entries.len()
    }

    /// Its own consistency: see [`Paged::check`].
    pub(crate) fn check(&self) -> Result<(), String> {
        self.log.check(&[self.stamp])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Push(u32),
        Set(usize, u32),
        Mark,
        /// Restore the k-th open mark (modulo their number).
        Restore(usize),
        /// Drop the k-th open mark.
        Forget(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => any::<u32>().prop_map(Op::Push),
            6 => (any::<usize>(), any::<u32>()).prop_map(|(i, v)| Op::Set(i, v)),
            1 => Just(Op::Mark),
            1 => any::<usize>().prop_map(Op::Restore),
            1 => any::<usize>().prop_map(Op::Forget),
        ]
    }

    /// Open marks, oldest first: (mark, the model's contents then).
    type Marks = Vec<(PagedMark, Vec<u32>)>;

    fn forget(v: &mut Paged<u32, 4>, marks: &mut Marks, k: usize) {
        marks.remove(k);
        match marks.first() {
            Some(&(oldest, _)) => v.forget_before(oldest),
            None => v.forget_all(),
        }
    }

    proptest! {
        /// Against a plain vector and a copy of it per mark: every restore, to any open mark in
        /// any order, gives the contents at that mark, and logs nothing while no mark is open;
        /// the same for [`Logged`] holding the whole vector.
        #[test]
        fn restores_any_open_mark(ops in prop::collection::vec(op(), 1..300)) {
            let mut v: Paged<u32, 4> = Paged::default();
            // The same contents whole, in one logged value, marked alongside.
            let mut whole: Logged<Vec<u32>> = Logged::new(Vec::new());
            let mut whole_marks: Vec<PagedMark> = Vec::new();
            let mut model: Vec<u32> = Vec::new();
            let mut marks: Marks = Vec::new();
            for op in ops {
                match op {
                    Op::Push(x) => {
                        prop_assert_eq!(v.push(x), model.len());
                        whole.get_mut().push(x);
                        model.push(x);
                    }
                    Op::Set(i, x) => {
                        if model.is_empty() {
                            prop_assert!(v.get_mut(i).is_none());
                            continue;
                        }
                        let i = i % model.len();
                        *v.get_mut(i).unwrap() = x;
                        whole.get_mut()[i] = x;
                        model[i] = x;
                    }
                    Op::Mark => {
                        marks.push((v.mark(), model.clone()));
                        whole_marks.push(whole.mark());
                    }
                    Op::Restore(k) => {
                        if marks.is_empty() {
                            continue;
                        }
                        let k = k % marks.len();
                        let journaled = k + 1 < marks.len();
                        v.restore(marks[k].0, journaled);
                        whole.restore(whole_marks[k], journaled);
                        model = marks[k].1.clone();
                    }
                    Op::Forget(k) => {
                        if marks.is_empty() {
                            continue;
                        }
                        let k = k % marks.len();
                        forget(&mut v, &mut marks, k);
                        whole_marks.remove(k);
                        match whole_marks.first() {
                            Some(&oldest) => whole.forget_before(oldest),
                            None => whole.forget_all(),
                        }
                    }
                }
                prop_assert_eq!(v.check(), Ok(()));
                prop_assert_eq!(whole.check(), Ok(()));
                prop_assert_eq!(v.len(), model.len());
                prop_assert!(v.iter().copied().eq(model.iter().copied()));
                prop_assert_eq!(whole.get(), &model);
                if marks.is_empty() {
                    prop_assert_eq!(v.log_len(), 0);
                    prop_assert_eq!(whole.log_len(), 0);
                }
            }
        }
    }

    /// A restore with no later mark moves pages back instead of copying them: the page it
    /// puts back is the very allocation that was logged.
    #[test]
    fn restore_moves_pages_back() {
        let mut v: Paged<u64, 2> = Paged::default();
        for x in 0..6 {
            v.push(x);
        }
        let before: Vec<*const [u64; 2]> = v.pages.iter().map(|p| &**p as *const _).collect();
        let m = v.mark();
        *v.get_mut(0).unwrap() = 10;
        *v.get_mut(1).unwrap() = 11;
        *v.get_mut(5).unwrap() = 15;
        v.push(6);
        assert_eq!(
            v.log_len(),
            2,
            "one image per page changed, none for a new page"
        );
        v.restore(m, false);
        let after: Vec<*const [u64; 2]> = v.pages.iter().map(|p| &**p as *const _).collect();
        assert_eq!(before, after);
        assert!(v.iter().copied().eq(0..6));
        // The mark stays open: the next change is logged again.
        *v.get_mut(2).unwrap() = 12;
        assert_eq!(v.log_len(), 1);
    }
}
