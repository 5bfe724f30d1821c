use super::*;
use crate::error::ErrorKind;

#[test]
fn replicated_streams_may_carry_padding() {
    assert_eq!(row_layout(10, 10, 10, 2, 0, "l").unwrap(), RowLayout::Replicated);
    assert_eq!(row_layout(16, 16, 10, 4, 3, "l").unwrap(), RowLayout::Replicated);
    assert_eq!(row_layout(7, 7, 7, 1, 0, "l").unwrap(), RowLayout::Replicated);
}

#[test]
fn sequence_parallel_chunks_are_recognised() {
    // 10 tokens over 4 ranks: padded to 12, 3 rows each.
    assert_eq!(row_layout(3, 10, 10, 4, 2, "l").unwrap(), RowLayout::Sharded { chunk: 3 });
    // 9 tokens over 2 ranks, forward padded to 16 (CUDA-graph size): 8 rows each.
    assert_eq!(row_layout(8, 16, 9, 2, 1, "l").unwrap(), RowLayout::Sharded { chunk: 8 });
}

#[test]
fn anything_else_is_refused_naming_layer_rank_and_shapes() {
    let e = row_layout(4, 10, 10, 4, 1, "layer id 3 (after convention, slot 1)").unwrap_err();
    assert_eq!(e.kind, ErrorKind::ShapeContract);
    for part in ["layer id 3", "rank 1 of 4", "4 rows", "scheduled 10", "3 rows per rank"] {
        assert!(e.message.contains(part), "{part}: {e}");
    }
    assert!(row_layout(5, 10, 10, 1, 0, "l").unwrap_err().message.contains("n/a at TP=1"));
    // Fewer forward tokens than scheduled: never a valid shard.
    assert!(row_layout(3, 5, 10, 2, 0, "l").is_err());
}
