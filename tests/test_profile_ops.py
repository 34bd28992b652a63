"""benchmarks/profile_ops.py attributes a real compiled step's traced time to the operations
of its optimized HLO (tiny digits run; no timing asserted)."""

from benchmarks import profile_ops


def test_hlo_operations_names_each_instruction_with_its_jax_op():
    hlo = ('ENTRY %main (p: f32[2]) -> f32[2] {\n'
           '  %p = f32[2]{0} parameter(0)\n'
           '  %dot.3 = f32[2]{0} dot(%p, %p), metadata={op_name="jit(f)/dot_general"}\n'
           '  ROOT %tanh_fusion = f32[2]{0} fusion(%dot.3), kind=kLoop\n}')
    assert profile_ops.hlo_operations(hlo) == {"p": "", "dot.3": "jit(f)/dot_general",
                                               "tanh_fusion": ""}


def test_a_dpsgd_step_is_profiled_per_operation():
    spec = dict(gin_files=["pipelines/dpsgd", "gin/data/digits.gin"], noise_multiplier=1.0,
                bindings=["train.batch_size = 64", "train.micro_batch_size = 32"])
    totals, operations = profile_ops.profile(spec, steps=3, warmup=1)
    assert totals and set(totals) <= set(operations)
    assert all(us > 0 for us in totals.values())
    # the model's matmuls ran and were attributed to their JAX operations
    assert any("dot_general" in operations[name] for name in totals)
    text = profile_ops.table(totals, operations, steps=3, top=5)
    assert text.count("\n| ") == min(5, len(totals)) and "per step (summed over threads)" in text


def test_a_control_flow_operation_is_charged_its_own_time_only():
    operations = {"while.1": "", "dot.2": "", "add.3": ""}
    events = [dict(ph="X", name="while.1", ts=0, dur=100, pid=1, tid=1),
              dict(ph="X", name="dot.2", ts=10, dur=30, pid=1, tid=1),
              dict(ph="X", name="add.3", ts=50, dur=20, pid=1, tid=1),
              dict(ph="X", name="dot.2", ts=5, dur=40, pid=1, tid=2),   # another thread
              dict(ph="X", name="PjitFunction(f)", ts=0, dur=500, pid=1, tid=1)]
    assert profile_ops.per_operation_us(events, operations) == {
        "while.1": 50, "dot.2": 70, "add.3": 20}


def test_a_gpu_kernel_is_charged_to_the_instruction_in_its_args():
    """On a GPU the trace names a kernel by itself (cuBLAS's, a fusion's) and its HLO
    instruction in args.hlo_op; a kernel of no instruction of the step is left out."""
    operations = {"custom-call.4": "jit(step)/dot_general", "fusion.7": "jit(step)/mul"}
    events = [dict(ph="X", name="sm90_xmma_gemm_f32f32_tf32f32", ts=0, dur=30, pid=2, tid=7,
                   args={"hlo_op": "custom-call.4"}),
              dict(ph="X", name="loop_multiply_fusion", ts=40, dur=5, pid=2, tid=7,
                   args={"hlo_op": "fusion.7"}),
              dict(ph="X", name="sm90_xmma_gemm_f32f32_tf32f32", ts=50, dur=20, pid=2, tid=7,
                   args={"hlo_op": "custom-call.4"}),
              dict(ph="X", name="other_module_kernel", ts=80, dur=9, pid=2, tid=7,
                   args={"hlo_op": "fusion.99"})]
    assert profile_ops.per_operation_us(events, operations) == {"custom-call.4": 50,
                                                                 "fusion.7": 5}


def test_the_command_line_has_the_flags_it_reads():
    # main reads --data_gin, --model_gin, --steps, --warmup and --bindings, which
    # benchmarks.speed defines: importing profile_ops alone must define them (bug: it did not,
    # and `python -m benchmarks.profile_ops` died with AttributeError: data_gin).
    import subprocess
    import sys
    code = ("import benchmarks.profile_ops as p; "
            "missing = [f for f in ('data_gin', 'model_gin', 'steps', 'warmup', 'bindings') "
            "if f not in p.FLAGS]; assert not missing, missing")
    subprocess.run([sys.executable, "-c", code], check=True)
