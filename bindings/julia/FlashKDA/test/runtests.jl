# SPDX-License-Identifier: MIT
# FlashKDA.jl on the CPU backend (and on CuArrays where CUDA.jl works):
# accuracy against an fp64 token-by-token recurrence on random inputs,
# plan reuse, bf16 conversions and the error paths.
#
#     FLASHKDA_LIBRARY=build/libflashkda.so.0 julia --project=bindings/julia/FlashKDA \
#         -e 'using Pkg; Pkg.test()'

using FlashKDA
using FlashKDA: FKDA_ERROR_INVALID_ARGUMENT, FKDA_ERROR_UNSUPPORTED, FKDA_ERROR_NO_DEVICE,
                FKDA_ERROR_UNSUPPORTED_ARCH
using Random
using Test

const DIM = 128
const BF16_NAN = 0x7fc0

sigmoid(x) = 1 / (1 + exp(-x))
softplus(x) = x > 20 ? x : log1p(exp(x))
# bf16 bit patterns or Float32 values as Float64.
widen_values(x::AbstractArray{UInt16}) = Float64.(from_bf16(x))
widen_values(x::AbstractArray{Float32}) = Float64.(x)
rel_l2(actual, expected) = sqrt(sum(abs2, Float64.(actual) .- expected) / sum(abs2, expected))

# Arrays in Julia order: q (K, H, T, B), beta (H, T, B), states (K, V, H, N).
# g and beta are bf16 bits or Float32; A_log and dt_bias nothing where the gate
# takes them absent; gate_mode and beta_mode those of the plan.
struct Problem
    q::Array{UInt16,4}
    k::Array{UInt16,4}
    v::Array{UInt16,4}
    g::Union{Array{UInt16,4},Array{Float32,4}}
    beta::Union{Array{UInt16,3},Array{Float32,3}}
    A_log::Union{Nothing,Vector{Float32}}
    dt_bias::Union{Nothing,Matrix{Float32}}
    scale::Float32
    lower_bound::Float32
    initial_state::Union{Nothing,Array{Float32,4}}
    cu_seqlens::Union{Nothing,Vector{Int64}}
    gate_mode::Symbol
    beta_mode::Symbol
end

Problem(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens) =
    Problem(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens,
            :bounded, :logits)

num_seqs(p::Problem) = p.cu_seqlens === nothing ? size(p.q, 4) : length(p.cu_seqlens) - 1

# Inputs as in docs/BENCHMARKS.md: q, k, v, g, beta ~ N(0, 1) in bf16; A_log,
# dt_bias ~ U(0, 1); initial state ~ 0.1 N(0, 1).
function make_problem(rng; batch=1, seq_len=40, heads=2, seq_lens=nothing, with_state=true,
                      lower_bound=-5.0f0)
    cu_seqlens = nothing
    if seq_lens !== nothing
        batch, seq_len = 1, sum(seq_lens)
        cu_seqlens = Int64[0; cumsum(seq_lens)]
    end
    n = cu_seqlens === nothing ? batch : length(cu_seqlens) - 1
    bf16_normal(dims...) = to_bf16(randn(rng, Float32, dims...))
    return Problem(bf16_normal(DIM, heads, seq_len, batch), bf16_normal(DIM, heads, seq_len, batch),
                   bf16_normal(DIM, heads, seq_len, batch), bf16_normal(DIM, heads, seq_len, batch),
                   bf16_normal(heads, seq_len, batch), rand(rng, Float32, heads),
                   rand(rng, Float32, DIM, heads), Float32(DIM)^-0.5f0, Float32(lower_bound),
                   with_state ? 0.1f0 .* randn(rng, Float32, DIM, DIM, heads, n) : nothing,
                   cu_seqlens)
end

with_initial_state(p::Problem, state) =
    Problem(p.q, p.k, p.v, p.g, p.beta, p.A_log, p.dt_bias, p.scale, p.lower_bound, state, p.cu_seqlens,
            p.gate_mode, p.beta_mode)

# `p` in another gate and beta form: softplus takes Kimi-Linear's parameters
# (A_log = log U(1, 16), dt_bias the inverse softplus of log-uniform values in
# [0.001, 0.1]); log_decay g ~ N(-0.5, 0.5) itself (Float32 with f32_g) and
# no A_log, dt_bias; probabilities beta ~ U(-0.1, 1.1) (Float32 with f32_beta).
function in_form(rng, p::Problem; gate_mode=:bounded, beta_mode=:logits, f32_g=false,
                 f32_beta=false, with_A_log=true, with_dt_bias=true)
    heads = size(p.q, 2)
    g, beta, A_log, dt_bias = p.g, p.beta, p.A_log, p.dt_bias
    if gate_mode == :softplus
        A_log = Float32.(log.(1 .+ 15 .* rand(rng, heads)))
        dt_bias = Float32.(log.(expm1.(exp.(log(1e-3) .+ (log(1e-1) - log(1e-3)) .* rand(rng, DIM, heads)))))
    elseif gate_mode == :log_decay
        g = to_bf16(-0.5f0 .+ 0.5f0 .* randn(rng, Float32, size(p.g)))
        A_log, dt_bias = nothing, nothing
    end
    if beta_mode == :probabilities
        beta = to_bf16(-0.1f0 .+ 1.2f0 .* rand(rng, Float32, size(p.beta)))
    end
    g = f32_g ? from_bf16(g) : g
    beta = f32_beta ? from_bf16(beta) : beta
    A_log = with_A_log ? A_log : nothing
    dt_bias = with_dt_bias ? dt_bias : nothing
    lower_bound = gate_mode == :bounded ? p.lower_bound : -5.0f0
    return Problem(p.q, p.k, p.v, g, beta, A_log, dt_bias, p.scale, lower_bound, p.initial_state,
                   p.cu_seqlens, gate_mode, beta_mode)
end

# Log-decays of head h for the gate inputs g (a K-vector), as the header's
# fkda_gate_mode defines them.
function log_decays(p::Problem, h, g)
    p.gate_mode == :log_decay && return min.(g, 0.0)
    rate = p.A_log === nothing ? 1.0 : exp(Float64(p.A_log[h]))
    bias = p.dt_bias === nothing ? zeros(DIM) : Float64.(p.dt_bias[:, h])
    p.gate_mode == :softplus && return -rate .* softplus.(g .+ bias)
    return Float64(p.lower_bound) .* sigmoid.(rate .* (g .+ bias))
end

step_size(p::Problem, beta) = p.beta_mode == :probabilities ? clamp(beta, 0.0, 1.0) : sigmoid(beta)

# The token-by-token recurrence in Float64, S held as V×K.
function reference(p::Problem)
    _, heads, seq_len, batch = size(p.q)
    sequences = p.cu_seqlens === nothing ? [(b, 1, seq_len) for b in 1:batch] :
                [(1, p.cu_seqlens[n] + 1, p.cu_seqlens[n+1]) for n in 1:length(p.cu_seqlens)-1]
    out = zeros(Float64, DIM, heads, seq_len, batch)
    final_state = zeros(Float64, DIM, DIM, heads, length(sequences))
    for (n, (b, start_t, stop_t)) in enumerate(sequences), h in 1:heads
        S = p.initial_state === nothing ? zeros(DIM, DIM) :
            Float64.(permutedims(p.initial_state[:, :, h, n]))
        for t in start_t:stop_t
            widened(x) = widen_values(x[:, h, t, b])
            q, k, v, g = widened(p.q), widened(p.k), widened(p.v), widened(p.g)
            q_hat = q ./ sqrt(sum(abs2, q) + 1e-6)
            k_hat = k ./ sqrt(sum(abs2, k) + 1e-6)
            gate = log_decays(p, h, g)
            write_strength = step_size(p, widen_values(p.beta[h:h, t, b])[1])
            S = S .* exp.(gate)'
            S = S .+ write_strength .* (v .- S * k_hat) .* k_hat'
            out[:, h, t, b] = p.scale .* (S * q_hat)
        end
        final_state[:, :, h, n] = permutedims(S)
    end
    return out, final_state
end

function run_problem(p::Problem; plan=nothing)
    out = fill(BF16_NAN, size(p.v))
    final_state = fill(NaN32, DIM, DIM, size(p.q, 2), num_seqs(p))
    if plan === nothing
        fwd!(p.q, p.k, p.v, p.g, p.beta, p.scale, out, p.A_log, p.dt_bias, p.lower_bound;
             initial_state=p.initial_state, final_state=final_state, cu_seqlens=p.cu_seqlens,
             gate_mode=p.gate_mode, beta_mode=p.beta_mode)
    else
        fwd!(plan, p.q, p.k, p.v, p.g, p.beta, p.scale, out, p.A_log, p.dt_bias;
             initial_state=p.initial_state, final_state=final_state, cu_seqlens=p.cu_seqlens)
    end
    return out, final_state
end

function check_accuracy(p::Problem, out, final_state)
    out_f32 = from_bf16(out)
    @test !any(isnan, out_f32)          # every element written
    @test !any(isnan, final_state)
    expected_out, expected_state = reference(p)
    @test rel_l2(out_f32, expected_out) <= 6e-3
    @test rel_l2(final_state, expected_state) <= 5e-3
end

# The layer step's convolution of one projection in Float64, every sequence
# starting from its row of `state`: raw (K, H, T, B) bf16, weight (W, H*K),
# bias (H*K,), state (Wc, H*K, N). Returns the convolved inputs rounded to
# bf16, as fwd! stages them, and the conv states after the call.
function convolve(p::Problem, raw, weight, bias, state)
    _, heads, seq_len, batch = size(raw)
    width, state_width = size(weight, 1), size(state, 1)
    sequences = p.cu_seqlens === nothing ? [(b, 1, seq_len) for b in 1:batch] :
                [(1, p.cu_seqlens[n] + 1, p.cu_seqlens[n+1]) for n in 1:length(p.cu_seqlens)-1]
    convolved = copy(raw)
    after = copy(state)
    for (n, (b, start_t, stop_t)) in enumerate(sequences)
        stop_t < start_t && continue
        for h in 1:heads, i in 1:DIM
            c = (h - 1) * DIM + i
            window = vcat(Float64.(state[:, c, n]), [Float64(from_bf16(raw[i, h, t, b])) for t in start_t:stop_t])
            for (j, t) in enumerate(start_t:stop_t)
                taps = window[state_width+j-width+1:state_width+j]
                pre = bias[c] + sum(Float64.(weight[:, c]) .* taps)
                convolved[i, h, t, b] = to_bf16(Float32(pre * sigmoid(pre)))
            end
            after[:, c, n] = window[end-state_width+1:end]
        end
    end
    return convolved, after
end

# RMSNorm(o) * w * sigmoid(g_out) over each head's V values, in place.
function gate_output!(out, gate, norm_weight)
    for index in CartesianIndices(size(out)[2:end])
        o = out[:, index]
        inverse_rms = 1 / sqrt(sum(abs2, o) / length(o) + 1e-5)
        out[:, index] = o .* inverse_rms .* Float64.(norm_weight) .* sigmoid.(Float64.(from_bf16(gate[:, index])))
    end
    return out
end

function expect_error(f, argument; status=FKDA_ERROR_INVALID_ARGUMENT)
    caught = try
        f()
        nothing
    catch error
        error
    end
    @test caught isa FlashKDAError
    caught isa FlashKDAError || return caught
    @test caught.status == status
    @test startswith(caught.message, argument * ":") || startswith(caught.message, "desc." * argument * ":")
    return caught
end

@testset "FlashKDA" begin
    rng = MersenneTwister(20261130)

    @testset "library" begin
        @test FlashKDA.version() == FlashKDA.FKDA_VERSION_NUMBER
        @test version_string() == "$(FlashKDA.FKDA_VERSION_MAJOR).$(FlashKDA.FKDA_VERSION_MINOR).$(FlashKDA.FKDA_VERSION_PATCH)"
        @test isfile(library_path())
        info = query_device()
        @test info.device_count >= 0
        info.driver_loaded || @test info.device_count == 0
        expect_error(() -> query_device(-2), "device")
        build = build_info()
        @test build.cuda_version >= build.min_driver_version >= 12000
        @test "sm_80" in split(build.architectures)
        @test sizeof(FlashKDA.fkda_tensor) == 8 + 4 + 4 + 6 * 8 + 6 * 8
    end

    @testset "batched forward, f32 state" begin
        p = make_problem(rng; batch=2, seq_len=37, heads=2)
        check_accuracy(p, run_problem(p)...)
    end

    @testset "batched forward, bf16 state" begin
        p = make_problem(rng; batch=1, seq_len=29, heads=2)
        initial = to_bf16(p.initial_state)
        out = fill(BF16_NAN, size(p.v))
        final_state = fill(BF16_NAN, size(initial))
        fwd!(p.q, p.k, p.v, p.g, p.beta, p.scale, out, p.A_log, p.dt_bias, p.lower_bound;
             initial_state=initial, final_state=final_state)
        check_accuracy(with_initial_state(p, from_bf16(initial)), out, from_bf16(final_state))
    end

    @testset "varlen forward, $(T) offsets" for T in (Int64, Int32)
        p = make_problem(rng; seq_lens=[21, 0, 40, 3], heads=2)
        out = fill(BF16_NAN, size(p.v))
        final_state = fill(NaN32, DIM, DIM, 2, num_seqs(p))
        fwd!(p.q, p.k, p.v, p.g, p.beta, p.scale, out, p.A_log, p.dt_bias, p.lower_bound;
             initial_state=p.initial_state, final_state=final_state, cu_seqlens=T.(p.cu_seqlens))
        check_accuracy(p, out, final_state)
    end

    @testset "without states" begin
        p = make_problem(rng; seq_len=33, heads=1, with_state=false)
        out = fill(BF16_NAN, size(p.v))
        fwd!(p.q, p.k, p.v, p.g, p.beta, p.scale, out, p.A_log, p.dt_bias, p.lower_bound)
        expected_out, _ = reference(p)
        @test !any(isnan, from_bf16(out))
        @test rel_l2(from_bf16(out), expected_out) <= 6e-3
    end

    @testset "strided views give the contiguous result" begin
        p = make_problem(rng; batch=2, seq_len=19, heads=2)
        contiguous_out, contiguous_state = run_problem(p)
        function wider_heads(array)
            wide = rand(rng, UInt16, DIM, 4, size(array, 3), size(array, 4))
            view_of = view(wide, :, 2:3, :, :)
            view_of .= array
            return view_of
        end
        q, k, v, g = wider_heads(p.q), wider_heads(p.k), wider_heads(p.v), wider_heads(p.g)
        out = wider_heads(fill(BF16_NAN, size(p.v)))
        final_state = fill(NaN32, size(contiguous_state))
        fwd!(q, k, v, g, p.beta, p.scale, out, p.A_log, p.dt_bias, p.lower_bound;
             initial_state=p.initial_state, final_state=final_state)
        @test out == contiguous_out
        @test final_state == contiguous_state
    end

    @testset "plan reuse" begin
        plan = Plan(2; backend=:cpu)
        @test backend(plan) == :cpu
        first_problem = make_problem(rng; seq_len=24, heads=2)
        out_a, _ = run_problem(first_problem; plan=plan)
        out_b, state_b = run_problem(first_problem; plan=plan)
        @test out_a == out_b
        check_accuracy(first_problem, out_b, state_b)
        set_lower_bound!(plan, -2.5)
        @test lower_bound(plan) == -2.5f0
        second_problem = make_problem(rng; seq_lens=[5, 50], heads=2, lower_bound=-2.5f0)
        check_accuracy(second_problem, run_problem(second_problem; plan=plan)...)
        close(plan)
        close(plan)  # idempotent
        @test !isopen(plan)
    end

    @testset "explicit workspace" begin
        p = make_problem(rng; seq_len=40, heads=2)
        plan = Plan(2; backend=:cpu)
        workspace = Vector{UInt8}(undef, workspace_size(plan, 40, 1) + 64)
        out = fill(BF16_NAN, size(p.v))
        final_state = fill(NaN32, DIM, DIM, 2, 1)
        fwd!(plan, p.q, p.k, p.v, p.g, p.beta, p.scale, out, p.A_log, p.dt_bias;
             initial_state=p.initial_state, final_state=final_state, workspace=workspace)
        check_accuracy(p, out, final_state)
        close(plan)
    end

    @testset "raw descriptors" begin
        p = make_problem(rng; seq_len=20, heads=2)
        expected_out, expected_state = run_problem(p)
        out = fill(BF16_NAN, size(p.v))
        final_state = fill(NaN32, size(expected_state))
        plan = Plan(2; backend=:cpu)
        GC.@preserve p out final_state begin
            described(a) = tensor(pointer(a), size(a))
            fwd_raw!(plan, described(p.q), described(p.k), described(p.v), described(p.g),
                     described(p.beta), p.scale, described(out), described(p.A_log),
                     described(p.dt_bias); initial_state=described(p.initial_state),
                     final_state=described(final_state))
        end
        @test out == expected_out
        @test final_state == expected_state
        close(plan)
    end

    @static if isdefined(Core, :BFloat16)
        @testset "Core.BFloat16 arrays" begin
            p = make_problem(rng; seq_len=17, heads=1)
            as_bf16(a) = reinterpret(Core.BFloat16, a)
            expected_out, expected_state = run_problem(p)
            out = fill(BF16_NAN, size(p.v))
            final_state = fill(NaN32, size(expected_state))
            fwd!(as_bf16(p.q), as_bf16(p.k), as_bf16(p.v), as_bf16(p.g), as_bf16(p.beta), p.scale,
                 as_bf16(out), p.A_log, p.dt_bias, p.lower_bound;
                 initial_state=p.initial_state, final_state=final_state)
            @test out == expected_out
        end
    end

    @testset "errors" begin
        p = make_problem(rng; seq_len=20, heads=2)
        out = zeros(UInt16, size(p.v))
        call(; overrides...) = begin
            a = merge((q=p.q, k=p.k, v=p.v, g=p.g, beta=p.beta, scale=p.scale, out=out,
                       A_log=p.A_log, dt_bias=p.dt_bias, lower_bound=p.lower_bound,
                       initial_state=p.initial_state, cu_seqlens=p.cu_seqlens), values(overrides))
            fwd!(a.q, a.k, a.v, a.g, a.beta, a.scale, a.out, a.A_log, a.dt_bias, a.lower_bound;
                 initial_state=a.initial_state, cu_seqlens=a.cu_seqlens)
        end
        # The library reports the wrong dtype, naming the argument.
        wrong_dtype = expect_error(() -> call(q=from_bf16(p.q)), "q")
        @test occursin("bf16", wrong_dtype.message)
        # No flashkda dtype at all: the binding reports it.
        expect_error(() -> call(k=Float64.(from_bf16(p.k))), "k")
        expect_error(() -> call(v=p.v[:, :, 1:end-1, :]), "v")
        expect_error(() -> call(beta=p.beta[:, 1:end-1, :]), "beta")
        expect_error(() -> call(dt_bias=p.dt_bias[:, 1:1]), "dt_bias")
        for name in (:q, :k, :v, :g, :beta, :out)
            expect_error(() -> call(; (name => nothing,)...), String(name))
        end
        expect_error(() -> call(A_log=[1, 2]), "A_log")
        expect_error(() -> call(g=collect(1:10)), "g")
        expect_error(() -> call(q=Dict(1 => 2)), "q")
        expect_error(() -> call(scale=Inf32), "scale")
        for bad in (-5.5, 0.5, NaN, -Inf)
            expect_error(() -> call(lower_bound=bad), "lower_bound")
            expect_error(() -> Plan(2; backend=:cpu, lower_bound=bad), "lower_bound")
            plan = Plan(2; backend=:cpu)
            expect_error(() -> set_lower_bound!(plan, bad), "lower_bound")
            @test lower_bound(plan) == -5.0f0
            close(plan)
        end
        expect_error(() -> call(lower_bound="steep"), "lower_bound")

        varlen = make_problem(rng; seq_lens=[10, 10], heads=2)
        offsets = copy(varlen.cu_seqlens)
        offsets[2], offsets[3] = 15, 12
        expect_error(() -> fwd!(varlen.q, varlen.k, varlen.v, varlen.g, varlen.beta, varlen.scale,
                                zeros(UInt16, size(varlen.v)), varlen.A_log, varlen.dt_bias, -5;
                                cu_seqlens=offsets), "cu_seqlens")

        expect_error(() -> Plan(0; backend=:cpu), "num_heads")
        expect_error(() -> Plan(2.5; backend=:cpu), "num_heads")
        expect_error(() -> Plan(2^40; backend=:cpu), "num_heads")
        expect_error(() -> Plan(2; backend=:tpu), "backend")
        expect_error(() -> Plan(2; backend=7), "backend")
        expect_error(() -> Plan(2; backend=:cpu, state_dtype=Float16), "state_dtype")
        expect_error(() -> Plan(2; backend=:cpu, state_layout=3), "state_layout")
        expect_error(() -> Plan(2; backend=:cpu, head_dim_k=64), "head_dim_k"; status=FKDA_ERROR_UNSUPPORTED)

        plan = Plan(2; backend=:cpu)
        expect_error(() -> workspace_size(plan, -1, 1), "total_tokens")
        expect_error(() -> workspace_size(plan, 1, -1), "num_seqs")
        expect_error(() -> fwd!(plan, p.q, p.k, p.v, p.g, p.beta, p.scale, out, p.A_log, p.dt_bias;
                                workspace=Dict(1 => 2)), "workspace")
        close(plan)
        for use in (() -> backend(plan), () -> lower_bound(plan), () -> set_lower_bound!(plan, -1),
                    () -> workspace_size(plan, 1, 1),
                    () -> fwd!(plan, p.q, p.k, p.v, p.g, p.beta, p.scale, out, p.A_log, p.dt_bias))
            expect_error(use, "plan")
        end

        if query_device().device_count == 0
            no_device = try
                Plan(1; backend=:gpu)
                nothing
            catch e
                e
            end
            @test no_device isa FlashKDAError
            @test no_device.status in (FKDA_ERROR_NO_DEVICE, FKDA_ERROR_UNSUPPORTED_ARCH)
            @test startswith(no_device.message, "desc.backend:")
        end
    end

    @testset "gate and beta forms: $(name)" for (name, form) in (
            "bounded without A_log and dt_bias" => (with_A_log=false, with_dt_bias=false),
            "softplus" => (gate_mode=:softplus,),
            "softplus without dt_bias" => (gate_mode=:softplus, with_dt_bias=false),
            "log_decay Float32 g" => (gate_mode=:log_decay, f32_g=true),
            "log_decay bf16 g" => (gate_mode=:log_decay,),
            "probabilities Float32 beta" => (beta_mode=:probabilities, f32_beta=true))
        p = in_form(rng, make_problem(rng; seq_lens=[21, 0, 40], heads=2); form...)
        check_accuracy(p, run_problem(p)...)
        plan = Plan(2; backend=:cpu, gate_mode=p.gate_mode, beta_mode=p.beta_mode)
        check_accuracy(p, run_problem(p; plan=plan)...)
        p.gate_mode == :bounded || expect_error(() -> lower_bound(plan), "plan")
        close(plan)
    end

    @testset "softplus equals log_decay given the same log-decays" begin
        p = in_form(rng, make_problem(rng; batch=2, seq_len=37, heads=2); gate_mode=:softplus)
        out, state = run_problem(p)
        decays = similar(p.q, Float32)
        for b in axes(p.q, 4), t in axes(p.q, 3), h in axes(p.q, 2)
            decays[:, h, t, b] = Float32.(log_decays(p, h, widen_values(p.g[:, h, t, b])))
        end
        same = Problem(p.q, p.k, p.v, decays, p.beta, nothing, nothing, p.scale, -5.0f0,
                       p.initial_state, p.cu_seqlens, :log_decay, :logits)
        same_out, same_state = run_problem(same)
        @test rel_l2(from_bf16(same_out), widen_values(out)) <= 1e-3
        @test rel_l2(same_state, Float64.(state)) <= 1e-3
    end

    @testset "form errors" begin
        p = make_problem(rng; seq_len=20, heads=2)
        out = zeros(UInt16, size(p.v))
        expect_error(() -> fwd!(p.q, p.k, p.v, p.g, p.beta, p.scale, out, nothing, p.dt_bias, nothing;
                                gate_mode=:softplus), "A_log")
        expect_error(() -> fwd!(p.q, p.k, p.v, p.g, p.beta, p.scale, out, nothing, p.dt_bias, nothing;
                                gate_mode=:log_decay), "dt_bias")
        expect_error(() -> fwd!(p.q, p.k, p.v, from_bf16(p.g), p.beta, p.scale, out, p.A_log,
                                p.dt_bias, -5), "g")
        expect_error(() -> fwd!(p.q, p.k, p.v, p.g, p.beta, p.scale, out, p.A_log, p.dt_bias, -2;
                                gate_mode=:softplus), "lower_bound")
        expect_error(() -> Plan(2; backend=:cpu, gate_mode=:sigmoid), "gate_mode")
        expect_error(() -> Plan(2; backend=:cpu, gate_mode=7), "gate_mode")
        expect_error(() -> Plan(2; backend=:cpu, beta_mode=:odds), "beta_mode")
        plan = Plan(2; backend=:cpu, gate_mode=:log_decay, lower_bound=nothing)
        expect_error(() -> set_lower_bound!(plan, -1), "plan")
        close(plan)
    end

    @testset "states in a pool" begin
        # One sequence per batch row; the pool (K, V, H, slots) holds their
        # initial states at scattered slots (0-based, as the library reads
        # them) and random states elsewhere.
        p = make_problem(rng; batch=3, seq_len=2, heads=2)
        slot_count = 6
        slots = Int32[4, 1, 5]
        before = randn(rng, Float32, DIM, DIM, 2, slot_count)
        for n in 1:3
            before[:, :, :, slots[n]+1] = p.initial_state[:, :, :, n]
        end
        expected_out, expected_state = reference(p)
        # Slots a call wrote hold the reference's state of their sequence;
        # every other slot is bit for bit as it was.
        function check_pool(pool, written, tolerance)
            for slot in 0:slot_count-1
                n = findfirst(==(slot), written)
                if n === nothing
                    @test pool[:, :, :, slot+1] == before[:, :, :, slot+1]
                else
                    @test rel_l2(pool[:, :, :, slot+1], expected_state[:, :, :, n]) <= tolerance
                end
            end
        end

        pool = copy(before)
        out = fill(BF16_NAN, size(p.v))
        decode!(p.q, p.k, p.v, p.g, p.beta, p.scale, out, p.A_log, p.dt_bias, p.lower_bound,
                pool, slots)
        @test !any(isnan, from_bf16(out))
        @test rel_l2(from_bf16(out), expected_out) <= 6e-3
        check_pool(pool, slots, 1e-4)

        # A prefill on the pool, the second sequence padding (index -1).
        padded = Int32[4, -1, 5]
        pool = copy(before)
        out = fill(BF16_NAN, size(p.v))
        plan = Plan(2; backend=:cpu)
        fwd!(plan, p.q, p.k, p.v, p.g, p.beta, p.scale, out, p.A_log, p.dt_bias;
             state_pool=pool, state_indices=padded)
        @test all(==(0x0000), out[:, :, :, 2])
        for n in (1, 3)
            @test rel_l2(from_bf16(out[:, :, :, n]), expected_out[:, :, :, n]) <= 6e-3
        end
        check_pool(pool, padded, 5e-3)

        outside = try
            decode!(plan, p.q, p.k, p.v, p.g, p.beta, p.scale, out, p.A_log, p.dt_bias, pool,
                    Int32[4, slot_count, 5])
            nothing
        catch e
            e
        end
        @test outside isa FlashKDAError && startswith(outside.message, "state_indices")
        @test decode_workspace_size(plan, 6, 3) >= 0
        close(plan)
    end

    @testset "layer step" begin
        p = make_problem(rng; seq_lens=[13, 0, 30], heads=2)
        width, state_width, channels = 4, 3, 2 * DIM
        weights = [0.5f0 .* randn(rng, Float32, width, channels) for _ in 1:3]
        biases = [0.2f0 .* randn(rng, Float32, channels) for _ in 1:3]
        # Raw inputs are bf16: states holding bf16 values compare exactly.
        states = [from_bf16(to_bf16(randn(rng, Float32, state_width, channels, 3))) for _ in 1:3]
        gate = to_bf16(randn(rng, Float32, size(p.v)))
        norm_weight = 1 .+ 0.3f0 .* randn(rng, Float32, DIM)
        convolved = [convolve(p, raw, weights[i], biases[i], states[i]) for (i, raw) in enumerate((p.q, p.k, p.v))]
        inputs = Problem(convolved[1][1], convolved[2][1], convolved[3][1], p.g, p.beta, p.A_log, p.dt_bias,
                         p.scale, p.lower_bound, p.initial_state, p.cu_seqlens)
        expected_out, expected_state = reference(inputs)
        gate_output!(expected_out, gate, norm_weight)

        # Per projection, through a temporary plan created with layer_step.
        conv_state = copy.(states)
        out = fill(BF16_NAN, size(p.v))
        final_state = fill(NaN32, DIM, DIM, 2, 3)
        fwd!(p.q, p.k, p.v, p.g, p.beta, p.scale, out, p.A_log, p.dt_bias, p.lower_bound;
             initial_state=p.initial_state, final_state=final_state, cu_seqlens=p.cu_seqlens,
             conv_weight=Tuple(weights), conv_bias=Tuple(biases), conv_state=Tuple(conv_state),
             out_gate=gate, out_norm_weight=norm_weight)
        @test !any(isnan, from_bf16(out))
        @test rel_l2(from_bf16(out), expected_out) <= 1e-2
        @test rel_l2(final_state, expected_state) <= 1e-2
        for i in 1:3
            @test conv_state[i] == convolved[i][2]
        end

        # Packed: torch's (W, 1, 3*H*K) weight and a (3*H*K,) bias, split into
        # views: the same bits. (A packed state of 3 rows would overlap itself.)
        packed_states = copy.(states)
        packed_out = fill(BF16_NAN, size(p.v))
        packed_final = fill(NaN32, DIM, DIM, 2, 3)
        plan = Plan(2; backend=:cpu, layer_step=true)
        fwd!(plan, p.q, p.k, p.v, p.g, p.beta, p.scale, packed_out, p.A_log, p.dt_bias;
             initial_state=p.initial_state, final_state=packed_final, cu_seqlens=p.cu_seqlens,
             conv_weight=reshape(hcat(weights...), width, 1, 3 * channels), conv_bias=vcat(biases...),
             conv_state=Tuple(packed_states), out_gate=gate, out_norm_weight=norm_weight)
        @test packed_out == out
        @test packed_final == final_state
        @test packed_states == conv_state
        @test workspace_size(plan, 43, 3) > 0
        close(plan)

        plain = Plan(2; backend=:cpu)
        call(plan; keywords...) =
            fwd!(plan, p.q, p.k, p.v, p.g, p.beta, p.scale, out, p.A_log, p.dt_bias;
                 cu_seqlens=p.cu_seqlens, keywords...)
        expect_error(() -> call(plain; conv_weight=Tuple(weights)), "layer.conv_weight_q")
        expect_error(() -> call(plain; conv_weight=weights[1:2]), "conv_weight")
        expect_error(() -> call(plain; conv_bias=zeros(Float32, 3 * channels + 1)), "conv_bias")
        expect_error(() -> call(plain; out_gate=gate), "layer.out_norm_weight")
        expect_error(() -> call(plain; out_gate=gate, out_norm_weight=norm_weight, out_norm_eps=0),
                     "layer.out_norm_eps")
        close(plain)
    end

    @testset "finding the library" begin
        missing_path = joinpath(mktempdir(), "libflashkda.so.0")
        not_found = try
            FlashKDA.open_library(missing_path, "test", true)
            nothing
        catch e
            e
        end
        @test not_found isa FlashKDAError
        @test not_found.status === nothing
        @test occursin(missing_path, not_found.message)
        # One library per session: plans hold its raw handles.
        switch = try
            load_library(missing_path)
            nothing
        catch e
            e
        end
        @test switch isa FlashKDAError && occursin(missing_path, switch.message)
        @test load_library(library_path()).path == library_path()
    end

    @testset "bf16 conversions" begin
        patterns = collect(UInt16(0):typemax(UInt16))
        widened = from_bf16(patterns)
        nan = isnan.(widened)
        @test to_bf16(widened[.!nan]) == patterns[.!nan]
        @test all(isnan, from_bf16(to_bf16(widened[nan])))
        @test (to_bf16(widened[nan]) .& 0x8000) == (patterns[nan] .& 0x8000)
        step = 2.0f0^-7
        @test to_bf16(1.0f0 + step / 2) == to_bf16(1.0f0)
        @test to_bf16(1.0f0 + 3step / 2) == to_bf16(1.0f0 + 2step)
        @test to_bf16(floatmax(Float32)) == 0x7f80
        @test to_bf16(Inf32) == 0x7f80 && to_bf16(-Inf32) == 0xff80
        @test to_bf16(-0.0f0) == 0x8000
        # Independent rounding check: the nearer neighbour, ties to even.
        values = randn(rng, Float32, 10_000) .* 1000
        for x in values
            down = UInt16(reinterpret(UInt32, x) >> 16)
            up = down + 0x0001
            to_down = abs(Float64(x) - from_bf16(down))
            to_up = abs(Float64(from_bf16(up)) - x)
            expected = to_up < to_down || (to_up == to_down && isodd(down)) ? up : down
            @test to_bf16(x) == expected
        end
    end

    if Base.find_package("CUDA") !== nothing
        include("cuda.jl")
    else
        @info "CUDA.jl is not installed: CuArray tests skipped"
    end
end
