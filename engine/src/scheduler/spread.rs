//! Work of one step spread over threads: the grammar masks of the
//! constrained sequences. Each mask walks a grammar over the vocabulary;
//! with many constrained sequences in a batch, one thread computing them
//! one after another could outlast the forward pass they run beside.

/// `f` over every item, on up to `threads` threads (contiguous chunks, so
/// the results keep the items' order): the calling thread takes the first
/// chunk and scoped threads the rest. One item or one thread: the calling
/// thread alone.
pub(super) fn map_spread<T, R, F>(items: &mut [T], threads: usize, f: F) -> Vec<R>
where
    T: Send,
    R: Send,
    F: Fn(&mut T) -> R + Sync,
{
    let threads = threads.clamp(1, items.len().max(1));
    if threads == 1 {
        return items.iter_mut().map(&f).collect();
    }
    let per = items.len().div_ceil(threads);
    let (first, rest) = items.split_at_mut(per);
    std::thread::scope(|sc| {
        let f = &f;
        let handles: Vec<_> = rest
            .chunks_mut(per)
            .map(|chunk| sc.spawn(move || chunk.iter_mut().map(f).collect::<Vec<R>>()))
            .collect();
        let mut out: Vec<R> = first.iter_mut().map(f).collect();
        for h in handles {
            out.extend(h.join().unwrap_or_default());
        }
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::Mutex;

    #[test]
    fn items_are_mapped_in_order_on_as_many_threads_as_asked() {
        let seen = Mutex::new(HashSet::new());
        let mut items: Vec<usize> = (0..10).collect();
        let out = map_spread(&mut items, 4, |x| {
            seen.lock().unwrap().insert(std::thread::current().id());
            *x * 2
        });
        assert_eq!(out, (0..10).map(|x| x * 2).collect::<Vec<_>>());
        assert_eq!(seen.lock().unwrap().len(), 4, "four chunks, four threads");
        let mut one = vec![7];
        assert_eq!(map_spread(&mut one, 4, |x| *x), vec![7]);
        let mut none: Vec<usize> = Vec::new();
        assert!(map_spread(&mut none, 4, |x| *x).is_empty());
    }
}
