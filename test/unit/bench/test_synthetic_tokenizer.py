from transformers import AutoTokenizer

from gyrfalcon.bench.synthetic_tokenizer import make_synthetic_tokenizer


def test_round_trip_and_vocab_of_the_model(tmp_path):
    out = make_synthetic_tokenizer("benchmarks/models/smollm2-135m", str(tmp_path / "tok"))
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 49152
    ids = [5, 49151, 1234]
    assert tok.decode(ids) == "<5> <49151> <1234>"
    assert tok.encode("<5> <49151> <1234>", add_special_tokens=False) == ids
    text = tok.apply_chat_template(
        [{"role": "user", "content": "<7>"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("assistant:")
