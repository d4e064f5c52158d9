"""The planner widget: good input draws the chart, bad input shows a message, never a traceback."""
import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from course_utils import planner  # noqa: E402
from course_utils.planner import widget as pw  # noqa: E402


def test_render_good_input_draws_a_chart():
    result = pw.render(model="gpt2-xl", gpu="RTX 3060 (12 GB)", micro_batch=4, size=1024, accumulation=8)
    assert result.ok and result.figure is not None
    assert "does NOT fit" in result.message and "Cheapest set that fits" in result.message
    assert result.recommendation.plan.fits


def test_chart_legend_and_budget_label_cover_nothing():
    result = pw.render(model="gpt2-xl", micro_batch=4, size=1024, accumulation=8)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = result.figure
    ax = fig.axes[0]
    renderer = FigureCanvasAgg(fig).get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    axes_box = ax.get_window_extent(renderer)
    assert legend.x0 >= axes_box.x1  # beside the bars, not over them
    assert any("RTX 3060" in t.get_text() for t in ax.get_legend().get_texts())  # the budget is named there
    assert not ax.texts  # so no label on the chart can collide with the title


@pytest.mark.parametrize("kwargs,text", [
    (dict(micro_batch=0), "micro_batch must be positive"),
    (dict(micro_batch=4, size=0), "must be positive"),
    (dict(model=pw.CUSTOM_MODEL, custom_params_m=0, micro_batch=4), "n_params must be positive"),
    (dict(model=pw.CUSTOM_MODEL, custom_act_mib=0, micro_batch=4), "activation_bytes_per_sample must be a positive"),
    (dict(gpu=pw.CUSTOM_GPU, custom_gpu_gib=0, micro_batch=4), "memory_gib must be a positive"),
    (dict(model="no such model", micro_batch=4), "Unknown model"),
    (dict(micro_batch=4, stream_grads=True), "master_on_cpu=True"),
])
def test_render_bad_input_returns_a_message_not_an_exception(kwargs, text):
    result = pw.render(**kwargs)
    assert not result.ok and result.figure is None
    assert text in result.message and result.message.startswith("Cannot plan this")


def test_render_budget_nothing_fits_keeps_the_chart_and_says_why():
    result = pw.render(model="gpt2-xl", gpu=pw.CUSTOM_GPU, custom_gpu_gib=1, micro_batch=4, size=1024)
    assert result.ok and "Nothing fits" in result.message


def test_render_attention_math_needs_more_than_fused():
    kw = dict(model="gpt2-medium", micro_batch=8, size=1024, search=False)
    math_path, fused = pw.render(attention="math", **kw), pw.render(attention="fused (SDPA)", **kw)
    assert math_path.plan.peak_bytes > fused.plan.peak_bytes


def test_widget_builds_and_reacts():
    box = planner.planner_widget()
    assert box.last_result.ok
    box.controls["micro_batch"].value = 0  # a bad value: message, no exception
    assert not box.last_result.ok and "micro_batch must be positive" in box.last_result.message
    box.controls["micro_batch"].value = 2
    box.controls["stream_grads"].value = True  # turns the CPU optimizer on by itself
    assert box.controls["master_on_cpu"].value and box.last_result.ok
    box.controls["model"].value = pw.MODEL_LABELS["efficientnet_b0"]
    assert box.controls["size"].value == 224 and box.last_result.ok


def test_widget_set_changes_model_and_gpu_and_returns_the_verdict():
    box = planner.planner_widget()
    text = box.set(model="gpt2", gpu="A100 (80 GB)", micro_batch=8, size=512, accumulation=1)
    assert text.startswith("gpt2 on A100 (80 GB)") and "-> fits" in text
    text = box.set(model="gpt2-xl", gpu="T4 (16 GB)", micro_batch=4, size=1024)
    assert "gpt2-xl on T4 (16 GB)" in text and "does NOT fit" in text
    with pytest.raises(ValueError, match="No control named"):
        box.set(colour="red")


def test_widget_toggles_of_the_current_toolbox():
    box = planner.planner_widget()
    box.set(model="gpt2-xl", gpu="T4 (16 GB)", micro_batch=4, size=1024, accumulation=1, precision="pure fp16",
            checkpointing="per block", search=False)
    before = box.last_result.plan.peak_bytes
    box.controls["stream_weights"].value = True  # turns the CPU optimizer on by itself
    assert box.controls["master_on_cpu"].value and box.last_result.ok
    assert box.last_result.plan.peak_bytes < before
    box.set(chunked_loss=True, offload_activations=True)
    assert box.last_result.ok and "stream weights from CPU" in box.last_result.plan.settings.techniques()
    box.controls["master_on_cpu"].value = False  # streaming weights needs it: both streams switch off
    assert not box.controls["stream_weights"].value and box.last_result.ok
    text = box.set(fused_update=True, accumulation=4)
    assert not box.last_result.ok and "set accumulation=1" in text
    box.set(fused_update=False, accumulation=1, lora_rank=8)
    assert box.last_result.ok and "LoRA adapters (rank 8)" in box.last_result.plan.settings.techniques()
