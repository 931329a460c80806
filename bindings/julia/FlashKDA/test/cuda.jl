# SPDX-License-Identifier: MIT
# CuArrays on the GPU backend (the FlashKDACUDAExt extension). Included by
# runtests.jl when CUDA.jl is installed; skipped without a working GPU.

using CUDA

if !CUDA.functional()
    @info "CUDA.jl finds no working GPU: CuArray tests skipped"
else
    @testset "CuArrays" begin
        rng = MersenneTwister(7)

        @testset "forward matches the recurrence" begin
            p = make_problem(rng; seq_lens=[300, 77, 0, 200], heads=4)
            device(a) = a === nothing ? nothing : CuArray(a)
            out = CUDA.fill(BF16_NAN, size(p.v))
            final_state = CUDA.fill(NaN32, DIM, DIM, 4, num_seqs(p))
            fwd!(device(p.q), device(p.k), device(p.v), device(p.g), device(p.beta), p.scale, out,
                 device(p.A_log), device(p.dt_bias), p.lower_bound;
                 initial_state=device(p.initial_state), final_state=final_state,
                 cu_seqlens=device(p.cu_seqlens))
            check_accuracy(p, Array(out), Array(final_state))
        end

        @testset "plan, workspace and stream" begin
            p = make_problem(rng; batch=2, seq_len=64, heads=2)
            plan = Plan(2; backend=:gpu)
            @test backend(plan) == :gpu
            workspace = CuArray{UInt8}(undef, workspace_size(plan, 128, 2))
            out = CUDA.fill(BF16_NAN, size(p.v))
            final_state = CUDA.fill(NaN32, DIM, DIM, 2, 2)
            stream = CuStream()
            fwd!(plan, CuArray(p.q), CuArray(p.k), CuArray(p.v), CuArray(p.g), CuArray(p.beta),
                 p.scale, out, CuArray(p.A_log), CuArray(p.dt_bias);
                 initial_state=CuArray(p.initial_state), final_state=final_state,
                 workspace=workspace, stream=stream)
            synchronize(stream)
            check_accuracy(p, Array(out), Array(final_state))
            if length(workspace) > 16
                too_small = CuArray{UInt8}(undef, length(workspace) - 16)
                caught = try
                    fwd!(plan, CuArray(p.q), CuArray(p.k), CuArray(p.v), CuArray(p.g),
                         CuArray(p.beta), p.scale, out, CuArray(p.A_log), CuArray(p.dt_bias);
                         initial_state=CuArray(p.initial_state), final_state=final_state,
                         workspace=too_small)
                    nothing
                catch e
                    e
                end
                @test caught isa FlashKDAError
                @test caught.status == FlashKDA.FKDA_ERROR_WORKSPACE_TOO_SMALL
            end
            close(plan)
        end

        @testset "decode on a device pool" begin
            # Slots 3 and 1 (0-based) hold the two sequences' initial states.
            p = make_problem(rng; batch=2, seq_len=3, heads=2)
            pool = randn(rng, Float32, DIM, DIM, 2, 4)
            pool[:, :, :, 4] = p.initial_state[:, :, :, 1]
            pool[:, :, :, 2] = p.initial_state[:, :, :, 2]
            device_pool = CuArray(pool)
            out = CUDA.fill(BF16_NAN, size(p.v))
            decode!(CuArray(p.q), CuArray(p.k), CuArray(p.v), CuArray(p.g), CuArray(p.beta), p.scale,
                    out, CuArray(p.A_log), CuArray(p.dt_bias), p.lower_bound, device_pool,
                    CuArray(Int32[3, 1]))
            expected_out, expected_state = reference(p)
            @test rel_l2(from_bf16(Array(out)), expected_out) <= 6e-3
            updated = Array(device_pool)
            @test rel_l2(updated[:, :, :, 4], expected_state[:, :, :, 1]) <= 1e-4
            @test rel_l2(updated[:, :, :, 2], expected_state[:, :, :, 2]) <= 1e-4
            @test updated[:, :, :, 1] == pool[:, :, :, 1] && updated[:, :, :, 3] == pool[:, :, :, 3]
        end

        @testset "device mistakes name the argument" begin
            p = make_problem(rng; seq_len=20, heads=2)
            out = CUDA.zeros(UInt16, size(p.v))
            # k stays on the host while the rest is on the device.
            expect_error(() -> fwd!(CuArray(p.q), p.k, CuArray(p.v), CuArray(p.g), CuArray(p.beta),
                                    p.scale, out, CuArray(p.A_log), CuArray(p.dt_bias), -5), "k")
            plan = Plan(2; backend=:cpu)
            expect_error(() -> fwd!(plan, CuArray(p.q), CuArray(p.k), CuArray(p.v), CuArray(p.g),
                                    CuArray(p.beta), p.scale, out, CuArray(p.A_log),
                                    CuArray(p.dt_bias)), "q")
            close(plan)
        end

        @testset "query_device matches CUDA.jl" begin
            info = query_device(0)
            @test info.driver_loaded
            @test info.device_count == length(CUDA.devices())
            capability = CUDA.capability(CuDevice(0))
            @test (info.cc_major, info.cc_minor) == (capability.major, capability.minor)
            @test info.name == CUDA.name(CuDevice(0))
        end
    end
end
