"""The wrapper-code parser on a hand-written wrapper in Inductor's shape (no torch needed)."""

from __future__ import annotations

from memprof.analysis.wrapper_code import parse_wrapper, scoped_calls

WRAPPER = '''
from torch._inductor.select_algorithm import extern_kernels
empty_strided_cuda = torch._C._dynamo.guards._empty_strided_cuda

class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def call(self, args):
        primals_1, primals_2, primals_3 = args
        args.clear()
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            buf0 = empty_strided_cuda((128, 1024), (1024, 1), torch.float32)
            # Topologically Sorted Source Nodes: [input_1], Original ATen: [aten.addmm]
            extern_kernels.addmm(primals_2, primals_3, reinterpret_tensor(primals_1, (256, 1024), (1, 256), 0), alpha=1, beta=1, out=buf0)
            buf1 = empty_strided_cuda((1, ), (1, ), torch.int64)
            # Topologically Sorted Source Nodes: [], Original ATen: []
            aten.randint.low_out(-9223372036854775808, 9223372036854775807, [1], out=buf1)
            buf3 = empty_strided_cuda((128, 1024), (1024, 1), torch.bool)
            buf4 = empty_strided_cuda((128, 1024), (1024, 1), torch.float32)
            buf0e = empty_strided_cuda((0, 4), (4, 1), torch.float32)
            stream0 = get_raw_stream(0)
            # Topologically Sorted Source Nodes: [input_2, input_3], Original ATen: [aten.gelu, aten.native_dropout]
            triton_poi_fused_gelu_native_dropout_0.run(buf1, buf0, buf3, buf4, 0, 131072, stream=stream0)
            del buf1
            buf5 = torch.ops.aten._scaled_dot_product_efficient_attention.default(buf4, buf4, buf4, None, True)
            buf6 = buf5[0]
            buf7 = reinterpret_tensor(buf0, (128, 1024), (1024, 1), 0); del buf0  # reuse
        return (buf6, primals_1, reinterpret_tensor(buf7, (1024, 128), (1, 1024), 0), buf3, None, )
'''


def test_allocations_calls_aliases_and_outputs() -> None:
    w = parse_wrapper(WRAPPER)
    assert w.inputs == ("primals_1", "primals_2", "primals_3")
    assert [(a.buf, a.nbytes) for a in w.allocs] == [
        ("buf0", 128 * 1024 * 4), ("buf1", 8), ("buf3", 128 * 1024), ("buf4", 128 * 1024 * 4), ("buf0e", 0)]
    assert [a.buf for a in w.expected_allocs] == ["buf0", "buf1", "buf3", "buf4"]  # 0 bytes never allocate
    assert [(c.kernel, c.scope, c.kind, c.out) for c in w.calls] == [
        ("addmm", "aten::addmm", "extern", None),
        ("randint", "aten::randint", "extern", None),
        ("triton_poi_fused_gelu_native_dropout_0", "triton_poi_fused_gelu_native_dropout_0", "triton", None),
        ("_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_efficient_attention", "extern", "buf5"),
    ]
    assert w.calls[2].source_nodes == ("input_2", "input_3")
    assert w.root("buf7") == "buf0" and w.root("buf6") == "buf5"
    assert w.outputs == ("buf5", "primals_1", "buf0", "buf3", None)
    assert w.writer["buf0"] == 0 and w.writer["buf1"] == 1 and w.writer["buf3"] == 2
    assert w.unsupported == ()


def test_unsupported_wrappers_are_named() -> None:
    assert parse_wrapper("int main() {}").unsupported == (
        "no Python wrapper call() (cpp_wrapper or an unknown wrapper)",)
    partitioned = WRAPPER.replace("class Runner:", "def partition_0(args):\n    pass\n\nclass Runner:")
    assert "graph partitions (CUDA graphs)" in parse_wrapper(partitioned).unsupported


def test_symbolic_sizes_are_unknown_not_wrong() -> None:
    w = parse_wrapper(WRAPPER.replace("(128, 1024), (1024, 1), torch.bool", "(s0, 1024), (1024, 1), torch.bool"))
    assert [a.nbytes for a in w.allocs if a.buf == "buf3"] == [None]


def test_symbolic_sizes_are_checked_per_call() -> None:
    """A dynamic graph's allocations are sized by expressions of its size symbols, whose values change
    every call: some value must explain every allocation of a call, exactly on the CPU and within the
    caching allocator's rounding on CUDA."""
    from memprof.analysis.wrapper_code import AllocSite, check_symbolic_sizes

    a = AllocSite("buf0", None, "(2*s50, 32)", "float32", 1, "(32, 1)")
    b = AllocSite("buf3", None, "(2, s50, 32)", "bool", 2, "(32*s50, 32, 1)")
    c = AllocSite("buf9", None, "(s50, s7)", "float32", 3, "(s7, 1)")
    assert a.size_of is not None and a.size_of({"s50": 10}) == 2 * 10 * 32 * 4
    assert check_symbolic_sizes([(a, 2560), (b, 640)], cpu=True) == ""  # s50 = 10 explains both
    assert "buf3" in check_symbolic_sizes([(a, 2560), (b, 704)], cpu=True)  # 704 B is s50 = 11
    assert "buf0" in check_symbolic_sizes([(a, 2561)], cpu=True)
    assert check_symbolic_sizes([(a, 3072), (b, 1024)], cpu=False) == ""  # 512-byte granules
    assert check_symbolic_sizes([(a, 2560), (c, 4000)], cpu=True) == ""  # s7 solved from buf9: 100
    assert "buf9" in check_symbolic_sizes([(a, 2560), (c, 4001)], cpu=True)
    odd = AllocSite("buf1", None, "(__import__('os').getpid(), 4)", "float32", 4, "(4, 1)")
    assert odd.size_of is None and check_symbolic_sizes([(odd, 16)], cpu=True) == ""  # never evaluated


def test_scoped_calls_are_the_overloads_that_return_fresh_tensors() -> None:
    """A wrapper runs quiet after its first call when every allocation it makes is either its own
    (`empty_strided_<device>`) or inside a `torch.ops` overload returning a fresh tensor, whose scope
    memprof opens; any other call that may allocate keeps its op scopes on (None)."""
    randint = "            aten.randint.low_out(-9223372036854775808, 9223372036854775807, [1], out=buf1)\n"
    assert randint in WRAPPER
    assert scoped_calls(WRAPPER) is None  # an out= call that is not a matmul
    quiet = WRAPPER.replace(randint, "")
    assert scoped_calls(quiet) == ("aten._scaled_dot_product_efficient_attention.default",)
    fresh = "buf5 = torch.ops.aten._scaled_dot_product_efficient_attention.default("
    for other in ("buf5 = aten._scaled_dot_product_efficient_attention(",  # no overload to wrap
                  "buf5 = extern_kernels.attention(", "buf5 = some_helper(", "buf5 = empty_strided("):
        assert scoped_calls(quiet.replace(fresh, other)) is None, other
    assert scoped_calls(quiet.replace("def call(self, args)", "def run(self, args)")) is None
