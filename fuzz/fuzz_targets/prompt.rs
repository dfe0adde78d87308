//! Fuzz prompt extraction: any bytes, as any operation, must parse or fail cleanly, and a
//! successful parse must yield a routing text for chat and completions.
#![no_main]

use inferlb::prompt::{json_depth, Operation, RequestView};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = json_depth(data);
    for op in [Operation::ChatCompletions, Operation::Completions, Operation::Other] {
        if let Ok(view) = RequestView::parse(op, data) {
            assert_eq!(view.routing_text.is_some(), op != Operation::Other);
        }
    }
});
