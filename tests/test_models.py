"""course_utils.models: real GPT-2 configs, fake builds, the course MLP."""
import pytest
import torch

from course_utils import models


def test_gpt2_xl_parameter_count_from_its_config():
    with models.fake_mode():
        model = models.build_gpt2("gpt2-xl", dtype=torch.float16)
    assert sum(p.numel() for p in model.parameters()) == models.GPT2_XL_PARAMS == 1_557_611_200
    assert next(model.parameters()).dtype == torch.float16
    assert torch.get_default_dtype() == torch.float32  # restored


def test_small_vocab_gets_valid_special_tokens():
    config = models.gpt2_config("gpt2", n_layer=1, vocab_size=300)
    assert config.bos_token_id == config.eos_token_id == 299
    assert models.gpt2_config("gpt2").eos_token_id == 50256


def test_mlp_shape():
    net = models.mlp(n_layers=3, width=16, in_features=8, n_classes=4)
    assert net(torch.randn(2, 8)).shape == (2, 4)
    assert sum(isinstance(m, torch.nn.Linear) for m in net) == 4


@pytest.mark.parametrize("call, match", [
    (lambda: models.gpt2_config("gpt-5"), "Unknown GPT-2 size"),
    (lambda: models.gpt2_config("gpt2", n_layer=0), "n_layer must be a positive integer"),
    (lambda: models.mlp(n_layers=-1), "n_layers must be a positive integer"),
    (lambda: models.mlp(width=2.5), "width must be a positive integer"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
