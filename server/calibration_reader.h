// The calibration reader the server uses for --calibration and
// LoadCalibration(path|content):
//   - an oscarkv calibration file (safetensors, kernels/calib/calibration_file.h);
//   - "rotationzoo:DIR": a directory with the published RotationZoo pair
//     k_rotation_*.pt and v_rotation_*.pt (needs the model layout, so only at
//     start with --calibration).
// Returns null when this build has no kernels/calib; the server then accepts
// only the data-free Hadamard rotation and says so.
#ifndef OSCARKV_SERVER_CALIBRATION_READER_H_
#define OSCARKV_SERVER_CALIBRATION_READER_H_

#include "server/service/kv_service.h"

namespace oscarkv {

CalibrationReader DefaultCalibrationReader();

}  // namespace oscarkv

#endif  // OSCARKV_SERVER_CALIBRATION_READER_H_
