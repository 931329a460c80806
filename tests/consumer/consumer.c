/* SPDX-License-Identifier: MIT */
/* Creates a CPU plan through the installed library and checks the run-time
 * version matches the header it was compiled against. */
#include <flashkda.h>
#include <stdio.h>

int main(void) {
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  fkda_plan_t plan = NULL;
  size_t bytes = 1;
  desc.num_heads = 2;
  desc.backend = FKDA_BACKEND_CPU;
  if (fkda_version() != FKDA_VERSION_NUMBER) {
    fprintf(stderr, "version mismatch: header %d, library %u\n", FKDA_VERSION_NUMBER, fkda_version());
    return 1;
  }
  if (fkda_plan_create(&desc, &plan) != FKDA_SUCCESS) {
    fprintf(stderr, "fkda_plan_create: %s\n", fkda_last_error());
    return 1;
  }
  if (fkda_plan_workspace_size(plan, 64, 1, &bytes) != FKDA_SUCCESS) return 1;
  fkda_plan_destroy(plan);
  printf("consumer: flashkda %s linked and ran\n", fkda_version_string());
  return 0;
}
