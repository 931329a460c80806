/* SPDX-License-Identifier: MIT */
/* The public header must be clean C99 and its _INIT macros usable as-is. */
#include <flashkda.h>

int main(void) {
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  fkda_fwd_args args = FKDA_FWD_ARGS_INIT;
  fkda_device_info info = FKDA_DEVICE_INFO_INIT;
  fkda_tensor none = FKDA_TENSOR_NONE;
  (void)desc;
  (void)args;
  (void)info;
  (void)none;
  return FKDA_VERSION_NUMBER > 0 ? 0 : 1;
}
