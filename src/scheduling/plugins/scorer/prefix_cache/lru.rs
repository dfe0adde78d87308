//! A compact least-recently-used set of block hashes, one per backend.
//!
//! Nodes live in a `Vec` and link to each other by index (`u32`), so an entry costs a 16-byte
//! node plus an 8-byte map slot — no allocation per entry and no pointer chasing through the
//! heap. The map is keyed by the low 32 bits of the block hash: of two blocks of one backend
//! that share them (about 30 pairs in a full 500k-block cache) the newer replaces the older,
//! which can only make the index forget a block early — never claim one it was not sent. Touching an entry moves it to the front; inserting into a full set reuses the node of
//! the entry at the back and reports the hash it evicted.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use super::index::PassThroughHasher;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy)]
struct Node {
    hash: u64,
    prev: u32,
    next: u32,
}

pub struct Lru {
    map: HashMap<u32, u32, BuildHasherDefault<PassThroughHasher>>,
    nodes: Vec<Node>,
    /// Most recently used.
    head: u32,
    /// Least recently used: evicted first.
    tail: u32,
    capacity: usize,
}

/// What [`Lru::touch`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Touch {
    /// The hash was present and is now the most recent.
    Refreshed,
    /// The hash is new.
    Inserted,
    /// The hash is new and the given one was evicted to make room.
    Replaced(u64),
}

impl Lru {
    /// The largest capacity a node index can address.
    pub const MAX: usize = NIL as usize - 1;

    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.clamp(1, Self::MAX);
        Lru {
            map: HashMap::default(),
            nodes: Vec::new(),
            head: NIL,
            tail: NIL,
            capacity,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        match prev {
            NIL => self.head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
    }

    fn push_front(&mut self, i: u32) {
        self.nodes[i as usize].prev = NIL;
        self.nodes[i as usize].next = self.head;
        if self.head != NIL {
            self.nodes[self.head as usize].prev = i;
        }
        self.head = i;
        if self.tail == NIL {
            self.tail = i;
        }
    }

    /// Mark `hash` as just used, inserting it (and evicting the oldest when full).
    pub fn touch(&mut self, hash: u64) -> Touch {
        if let Some(&i) = self.map.get(&(hash as u32)) {
            if self.head != i {
                self.unlink(i);
                self.push_front(i);
            }
            let held = self.nodes[i as usize].hash;
            if held != hash {
                // Another block with the same low 32 bits: the newer one takes the slot.
                self.nodes[i as usize].hash = hash;
                return Touch::Replaced(held);
            }
            return Touch::Refreshed;
        }
        if self.map.len() < self.capacity {
            let i = self.nodes.len() as u32;
            if self.nodes.len() == self.nodes.capacity() {
                // Grow by a quarter (not double) up to the capacity: large LRUs stay tight.
                let room = self.capacity - self.nodes.len();
                self.nodes
                    .reserve_exact((self.nodes.len() / 4).max(64).min(room));
            }
            self.nodes.push(Node {
                hash,
                prev: NIL,
                next: NIL,
            });
            self.map.insert(hash as u32, i);
            self.push_front(i);
            return Touch::Inserted;
        }
        let i = self.tail;
        let old = self.nodes[i as usize].hash;
        self.unlink(i);
        self.map.remove(&(old as u32));
        self.nodes[i as usize].hash = hash;
        self.map.insert(hash as u32, i);
        self.push_front(i);
        Touch::Replaced(old)
    }

    /// The same set bounded by `capacity`: the most recent entries kept in order, the rest
    /// returned as evicted. Rebuilt compactly (a capacity change is rare; O(len)).
    pub fn resized(&self, capacity: usize) -> (Lru, Vec<u64>) {
        let mut fresh = Lru::new(capacity);
        let recent_first: Vec<u64> = self.iter().collect();
        let keep = recent_first.len().min(fresh.capacity);
        let evicted = recent_first[keep..].to_vec();
        for hash in recent_first[..keep].iter().rev() {
            fresh.touch(*hash);
        }
        (fresh, evicted)
    }

    #[cfg(test)]
    pub fn contains(&self, hash: u64) -> bool {
        self.map.contains_key(&(hash as u32))
    }

    /// Hashes from most to least recent (tests and debugging).
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        let mut i = self.head;
        std::iter::from_fn(move || {
            (i != NIL).then(|| {
                let n = self.nodes[i as usize];
                i = n.next;
                n.hash
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used() {
        let mut lru = Lru::new(3);
        assert_eq!(lru.touch(1), Touch::Inserted);
        assert_eq!(lru.touch(2), Touch::Inserted);
        assert_eq!(lru.touch(3), Touch::Inserted);
        assert_eq!(lru.touch(1), Touch::Refreshed);
        assert_eq!(lru.iter().collect::<Vec<_>>(), vec![1, 3, 2]);
        assert_eq!(lru.touch(4), Touch::Replaced(2));
        assert_eq!(lru.iter().collect::<Vec<_>>(), vec![4, 1, 3]);
        assert!(!lru.contains(2));
        assert_eq!(lru.len(), 3);
        assert_eq!(lru.touch(5), Touch::Replaced(3));
        assert_eq!(lru.touch(6), Touch::Replaced(1));
        assert_eq!(lru.iter().collect::<Vec<_>>(), vec![6, 5, 4]);
    }

    #[test]
    fn same_low_bits_replace_instead_of_refresh() {
        let mut lru = Lru::new(4);
        let a = 0x0000_0001_0000_0007;
        let b = 0x0000_0002_0000_0007;
        assert_eq!(lru.touch(a), Touch::Inserted);
        assert_eq!(lru.touch(b), Touch::Replaced(a));
        assert_eq!(lru.touch(b), Touch::Refreshed);
        assert_eq!(lru.iter().collect::<Vec<_>>(), vec![b]);
    }

    #[test]
    fn capacity_one_and_refresh_of_head() {
        let mut lru = Lru::new(1);
        assert_eq!(lru.touch(9), Touch::Inserted);
        assert_eq!(lru.touch(9), Touch::Refreshed);
        assert_eq!(lru.touch(8), Touch::Replaced(9));
        assert_eq!(lru.iter().collect::<Vec<_>>(), vec![8]);
        assert_eq!(Lru::new(0).capacity(), 1);
    }

    #[test]
    fn resizing_keeps_the_most_recent_in_order() {
        let mut lru = Lru::new(5);
        for h in 1..=5 {
            lru.touch(h);
        }
        let (small, evicted) = lru.resized(3);
        assert_eq!(small.iter().collect::<Vec<_>>(), vec![5, 4, 3]);
        assert_eq!(evicted, vec![2, 1]);
        let (mut big, none) = small.resized(10);
        assert!(none.is_empty());
        assert_eq!(big.capacity(), 10);
        assert_eq!(big.touch(6), Touch::Inserted);
        assert_eq!(big.iter().collect::<Vec<_>>(), vec![6, 5, 4, 3]);
    }

    #[test]
    fn refreshing_the_tail_keeps_links_consistent() {
        let mut lru = Lru::new(4);
        for h in 1..=4 {
            lru.touch(h);
        }
        lru.touch(1);
        lru.touch(2);
        assert_eq!(lru.iter().collect::<Vec<_>>(), vec![2, 1, 4, 3]);
        assert_eq!(lru.touch(5), Touch::Replaced(3));
        assert_eq!(lru.touch(6), Touch::Replaced(4));
        assert_eq!(lru.iter().collect::<Vec<_>>(), vec![6, 5, 2, 1]);
    }
}
