"""tiny-v41 cut to 5 layers with every CSA2 role: Engram at layer 1, KV sources 1 and 3, index sources 1, 3 and 4,
the candidate source 3 (so layer 4 is a Reindex layer), DSpark taps 2-4, a 512-token vocabulary and no ViT (the
image token id would lie outside it). The full preset's 10 layers and 129k head only add compile time to tests
that need each role once (test_dspark, test_reindex_candidates, test_serving_replay's text case)."""

FIVE_LAYERS = dict(vocab_size=512, n_layers=5, compress_ratios=(0, 2, 2, 1, 1, 0, 0, 0), kv_source_layers=(1, 3),
                   index_source_layers=(1, 3, 4), candidate_source_layer=3, engram_layer_ids=(1,),
                   engram_num_embeddings=(630,), dspark_target_layer_ids=(2, 3, 4), vision_n_layers=0)
