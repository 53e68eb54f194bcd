//! Which waiting work starts at the next step: plain data, no model. Work waits in arrival order
//! and is admitted between steps while it fits: its sequences within the batch (`max_batch`
//! running at once) and its prompt tokens within the step's prefill budget, so that one step
//! never prefills without bound while other sequences wait for their next token. The first
//! waiting item always starts when nothing runs, however large, so nothing waits forever.

use std::collections::VecDeque;

/// What the scheduler needs to know of a waiting item.
pub trait Queued {
    /// Sequences it runs once admitted (a prompt's choices share one prefill, then one each).
    fn slots(&self) -> usize;
    /// Prompt tokens its first step prefills.
    fn prefill_tokens(&self) -> usize;
    /// Its client has gone: drop it without running it.
    fn cancelled(&self) -> bool;
    /// The last waiting item of its request: the request leaves the queue with it.
    fn ends_request(&self) -> bool;
}

#[derive(Debug)]
pub struct Scheduler<T> {
    waiting: VecDeque<T>,
    max_batch: usize,
    max_prefill_tokens: usize,
}

impl<T: Queued> Scheduler<T> {
    pub fn new(max_batch: usize, max_prefill_tokens: usize) -> Self {
        Self {
            waiting: VecDeque::new(),
            max_batch: max_batch.max(1),
            max_prefill_tokens: max_prefill_tokens.max(1),
        }
    }

    pub fn push(&mut self, item: T) {
        self.waiting.push_back(item);
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Requests waiting (not items: a request with several prompts is one).
    pub fn requests_waiting(&self) -> usize {
        self.waiting.iter().filter(|w| w.ends_request()).count()
    }

    /// Removes the waiting items whose clients have gone.
    pub fn drop_cancelled(&mut self) -> Vec<T> {
        self.take_where(|w| w.cancelled())
    }

    /// Removes and returns the waiting items `pred` picks, the others keeping their order.
    pub fn take_where(&mut self, pred: impl Fn(&T) -> bool) -> Vec<T> {
        let (gone, kept): (Vec<T>, Vec<T>) = self.waiting.drain(..).partition(|w| pred(w));
        self.waiting = kept.into();
        gone
    }

    /// The items to start now, in arrival order, given `running` sequences already in the batch.
    pub fn admit(&mut self, running: usize) -> Vec<T> {
        let mut admitted = Vec::new();
        let (mut slots, mut tokens) = (running, 0);
        while let Some(next) = self.waiting.front() {
            let idle = slots == 0 && admitted.is_empty();
            let fits =
                slots + next.slots() <= self.max_batch && tokens + next.prefill_tokens() <= self.max_prefill_tokens;
            if !(idle || fits) {
                break;
            }
            slots += next.slots();
            tokens += next.prefill_tokens();
            admitted.extend(self.waiting.pop_front());
        }
        admitted
    }

    /// Everything still waiting (at shutdown).
    pub fn drain(&mut self) -> Vec<T> {
        self.waiting.drain(..).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq)]
    struct Item {
        name: &'static str,
        slots: usize,
        tokens: usize,
        cancelled: bool,
        last: bool,
    }

    fn item(name: &'static str, slots: usize, tokens: usize) -> Item {
        Item {
            name,
            slots,
            tokens,
            cancelled: false,
            last: true,
        }
    }

    impl Queued for Item {
        fn slots(&self) -> usize {
            self.slots
        }
        fn prefill_tokens(&self) -> usize {
            self.tokens
        }
        fn cancelled(&self) -> bool {
            self.cancelled
        }
        fn ends_request(&self) -> bool {
            self.last
        }
    }

    fn names(items: &[Item]) -> Vec<&'static str> {
        items.iter().map(|i| i.name).collect()
    }

    #[test]
    fn admits_in_order_while_the_batch_has_room() {
        let mut s = Scheduler::new(4, 1000);
        for (name, slots) in [("a", 1), ("b", 2), ("c", 2), ("d", 1)] {
            s.push(item(name, slots, 10));
        }
        // a + b fill 3 of 4; c (2) does not fit, and d may not overtake it.
        assert_eq!(names(&s.admit(0)), ["a", "b"]);
        assert_eq!(s.admit(3), vec![]);
        assert_eq!(names(&s.admit(2)), ["c"]);
        assert_eq!(names(&s.admit(3)), ["d"]);
        assert!(s.is_empty());
    }

    #[test]
    fn the_prefill_budget_splits_long_prompts_across_steps() {
        let mut s = Scheduler::new(16, 100);
        for name in ["a", "b", "c"] {
            s.push(item(name, 1, 60));
        }
        assert_eq!(names(&s.admit(0)), ["a"]);
        assert_eq!(names(&s.admit(1)), ["b"]);
        // Too big for any budget or batch: still starts once nothing runs.
        s.push(item("huge", 32, 5000));
        assert_eq!(names(&s.admit(2)), ["c"]);
        assert_eq!(s.admit(3), vec![]);
        assert_eq!(names(&s.admit(0)), ["huge"]);
    }

    #[test]
    fn cancelled_items_are_dropped_and_requests_counted_once() {
        let mut s = Scheduler::new(1, 100);
        s.push(Item {
            last: false,
            ..item("r1-p0", 1, 1)
        });
        s.push(item("r1-p1", 1, 1));
        s.push(Item {
            cancelled: true,
            ..item("r2", 1, 1)
        });
        s.push(item("r3", 1, 1));
        assert_eq!(s.requests_waiting(), 3);
        assert_eq!(names(&s.drop_cancelled()), ["r2"]);
        assert_eq!(s.requests_waiting(), 2);
        assert_eq!(names(&s.admit(0)), ["r1-p0"]);
        assert_eq!(s.requests_waiting(), 2, "r1 still has a prompt waiting");
        assert_eq!(names(&s.admit(0)), ["r1-p1"]);
        assert_eq!(s.requests_waiting(), 1);
        assert_eq!(names(&s.drain()), ["r3"]);
    }
}
