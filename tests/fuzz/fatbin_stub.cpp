// SPDX-License-Identifier: MIT
// The fuzz build compiles the library's host sources without nvcc: these
// stand in for the fatbin that cmake/embed_fatbin.S.in embeds. No plan of
// the fuzz target is a GPU plan, so nothing ever loads them.
extern "C" {
extern const unsigned char flashkda_embedded_fatbin[] = {0};
extern const unsigned char flashkda_embedded_fatbin_end[] = {0};
}
