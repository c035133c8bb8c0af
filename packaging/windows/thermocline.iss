; Inno Setup 6 script of the Thermocline installer for Windows (built by
; .github/workflows/windows.yml after PyInstaller made build\dist-<flavour>\thermocline):
;
;   iscc /DAppVersion=0.1.0 /DFlavour=cpu  /DSourceDir=..\..\build\dist-cpu\thermocline  ^
;        /DIconFile=..\..\build\icons\thermocline.ico /O..\..\dist packaging\windows\thermocline.iss
;
; Per-user install (no administrator rights): %LOCALAPPDATA%\Programs\Thermocline, a Start-menu
; entry, an optional desktop icon, and an uninstaller (Settings > Apps). Both flavours share one
; AppId, so installing the GPU build over the CPU build replaces it, and back.
; The user's conversations, settings and models (%LOCALAPPDATA%\Thermocline) are kept on uninstall.

#ifndef AppVersion
  #define AppVersion "0.1.0"
#endif
#ifndef Flavour
  #define Flavour "cpu"
#endif
#ifndef SourceDir
  #define SourceDir "..\..\build\dist-" + Flavour + "\thermocline"
#endif
#ifndef IconFile
  #define IconFile "..\..\build\icons\thermocline.ico"
#endif
#if Flavour == "cuda"
  #define FlavourName "GPU (NVIDIA CUDA)"
  #define OutputName "Thermocline-GPU-" + AppVersion + "-Setup"
#else
  #define FlavourName "CPU"
  #define OutputName "Thermocline-" + AppVersion + "-Setup"
#endif

[Setup]
AppId={{6E0B7D2C-5B8E-4C1A-9E77-3F1C2A9D4E10}
AppName=Thermocline
AppVersion={#AppVersion}
AppVerName=Thermocline {#AppVersion} ({#FlavourName})
AppPublisher=Thermocline developers
DefaultDirName={autopf}\Thermocline
DefaultGroupName=Thermocline
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog
ArchitecturesAllowed=x64
ArchitecturesInstallIn64BitMode=x64
OutputBaseFilename={#OutputName}
SetupIconFile={#IconFile}
UninstallDisplayIcon={app}\Thermocline.exe
UninstallDisplayName=Thermocline ({#FlavourName})
Compression=lzma2/normal
SolidCompression=no
LZMANumBlockThreads=4
WizardStyle=modern
CloseApplications=yes
; The GPU build is several GB; a compressed size over 4.2 GB needs slices (/DSpan).
#ifdef Span
DiskSpanning=yes
#endif

[Languages]
Name: "english"; MessagesFile: "compiler:Default.isl"

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked

[InstallDelete]
; A previous install of the other flavour: its torch files must not linger next to this one.
Type: filesandordirs; Name: "{app}\_internal"

[Files]
Source: "{#SourceDir}\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{autoprograms}\Thermocline"; Filename: "{app}\Thermocline.exe"; Comment: "Chat with language models on this computer"
Name: "{autodesktop}\Thermocline"; Filename: "{app}\Thermocline.exe"; Tasks: desktopicon

[Run]
Filename: "{app}\Thermocline.exe"; Description: "{cm:LaunchProgram,Thermocline}"; Flags: nowait postinstall skipifsilent

[UninstallDelete]
; Written next to the program by the kernel cache (numba) and Python; the user's data is elsewhere.
Type: filesandordirs; Name: "{app}\_internal\engine\kernels\__pycache__"
Type: dirifempty; Name: "{app}\_internal\engine\kernels"
Type: dirifempty; Name: "{app}\_internal\engine"
Type: dirifempty; Name: "{app}\_internal"
Type: dirifempty; Name: "{app}"
