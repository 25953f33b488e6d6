// The calibration file reader the server uses for --calibration and
// LoadCalibration(path|content). Returns null when this build has no reader
// (kernels/calib's file format not linked); the server then accepts only the
// data-free Hadamard rotation and says so.
#ifndef OSCARKV_SERVER_CALIBRATION_READER_H_
#define OSCARKV_SERVER_CALIBRATION_READER_H_

#include "server/service/kv_service.h"

namespace oscarkv {

CalibrationReader DefaultCalibrationReader();

}  // namespace oscarkv

#endif  // OSCARKV_SERVER_CALIBRATION_READER_H_
